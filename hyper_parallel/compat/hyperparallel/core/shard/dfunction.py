"""HyperParallel's module path ``hyper_parallel.core.shard.dfunction``: an alias of :mod:`hyper_parallel.dispatch.dfunction` (the file lives in ``hyper_parallel/compat/hyperparallel/core/``)."""
import sys

from hyper_parallel.dispatch import dfunction as _home

sys.modules[__name__] = _home
