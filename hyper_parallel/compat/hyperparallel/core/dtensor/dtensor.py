"""HyperParallel's module path ``hyper_parallel.core.dtensor.dtensor``: an alias of :mod:`hyper_parallel.dtensor.dtensor` (the file lives in ``hyper_parallel/compat/hyperparallel/core/``)."""
import sys

from hyper_parallel.dtensor import dtensor as _home

sys.modules[__name__] = _home
