"""HyperParallel's module path ``hyper_parallel.core.shard.dfunction``: an alias of :mod:`hyper_parallel.dispatch.dfunction` (see ``hyper_parallel/compat/``)."""
import sys

from hyper_parallel.dispatch import dfunction as _home

sys.modules[__name__] = _home
