"""HyperParallel's module path ``hyper_parallel.core.shard.sharding_plan``: an alias of :mod:`hyper_parallel.compat.hyperparallel.sharding_plan` (the file lives in ``hyper_parallel/compat/hyperparallel/core/``)."""
import sys

from hyper_parallel.compat.hyperparallel import sharding_plan as _home

sys.modules[__name__] = _home
