"""HyperParallel's module path ``hyper_parallel.core.dtensor.random``: an alias of :mod:`hyper_parallel.dtensor.random` (the file lives in ``hyper_parallel/compat/hyperparallel/core/``)."""
import sys

from hyper_parallel.dtensor import random as _home

sys.modules[__name__] = _home
