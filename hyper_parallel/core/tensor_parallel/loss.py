"""HyperParallel's module path ``hyper_parallel.core.tensor_parallel.loss``: an alias of :mod:`hyper_parallel.tensor_parallel.loss` (see ``hyper_parallel/compat/``)."""
import sys

from hyper_parallel.tensor_parallel import loss as _home

sys.modules[__name__] = _home
