"""HyperParallel's module path ``hyper_parallel.core.shard.api``: an alias of :mod:`hyper_parallel.compat.hyperparallel.shard_module` (the file lives in ``hyper_parallel/compat/hyperparallel/core/``)."""
import sys

from hyper_parallel.compat.hyperparallel import shard_module as _home

sys.modules[__name__] = _home
