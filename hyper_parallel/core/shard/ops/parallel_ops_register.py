"""HyperParallel's module path ``hyper_parallel.core.shard.ops.parallel_ops_register``: an alias of :mod:`hyper_parallel.compat.hp_parallel_ops_register` (see ``hyper_parallel/compat/``)."""
import sys

from hyper_parallel.compat import hp_parallel_ops_register as _home

sys.modules[__name__] = _home
