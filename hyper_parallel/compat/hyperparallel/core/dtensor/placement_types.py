"""HyperParallel's module path ``hyper_parallel.core.dtensor.placement_types``: an alias of :mod:`hyper_parallel.dtensor.placement_types` (the file lives in ``hyper_parallel/compat/hyperparallel/core/``)."""
import sys

from hyper_parallel.dtensor import placement_types as _home

sys.modules[__name__] = _home
