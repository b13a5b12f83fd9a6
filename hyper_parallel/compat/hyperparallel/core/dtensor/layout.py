"""HyperParallel's module path ``hyper_parallel.core.dtensor.layout``: an alias of :mod:`hyper_parallel.dtensor.layout` (the file lives in ``hyper_parallel/compat/hyperparallel/core/``)."""
import sys

from hyper_parallel.dtensor import layout as _home

sys.modules[__name__] = _home
