"""HyperParallel's module path ``hyper_parallel.core.dtensor.device_mesh``: an alias of :mod:`hyper_parallel.dtensor.device_mesh` (the file lives in ``hyper_parallel/compat/hyperparallel/core/``)."""
import sys

from hyper_parallel.dtensor import device_mesh as _home

sys.modules[__name__] = _home
