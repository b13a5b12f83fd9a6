"""HyperParallel's module path ``hyper_parallel.core.shard._op_dispatch``: an alias of :mod:`hyper_parallel.compat.hp_op_dispatch` (see ``hyper_parallel/compat/``)."""
import sys

from hyper_parallel.compat import hp_op_dispatch as _home

sys.modules[__name__] = _home
