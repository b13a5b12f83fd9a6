"""HyperParallel's module path ``hyper_parallel.core.utils.shape_utils``: an alias of :mod:`hyper_parallel.compat.hp_shape_utils` (see ``hyper_parallel/compat/``)."""
import sys

from hyper_parallel.compat import hp_shape_utils as _home

sys.modules[__name__] = _home
