"""HyperParallel's module path ``hyper_parallel.core.dtensor.tensor_redistribution``: an alias of :mod:`hyper_parallel.compat.hp_tensor_redistribution` (see ``hyper_parallel/compat/``)."""
import sys

from hyper_parallel.compat import hp_tensor_redistribution as _home

sys.modules[__name__] = _home
