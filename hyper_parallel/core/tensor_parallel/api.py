"""HyperParallel's module path ``hyper_parallel.core.tensor_parallel.api``: an alias of :mod:`hyper_parallel.tensor_parallel.api` (see ``hyper_parallel/compat/``)."""
import sys

from hyper_parallel.tensor_parallel import api as _home

sys.modules[__name__] = _home
