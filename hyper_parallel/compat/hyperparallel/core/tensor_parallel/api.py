"""HyperParallel's module path ``hyper_parallel.core.tensor_parallel.api``: an alias of :mod:`hyper_parallel.tensor_parallel.api` (the file lives in ``hyper_parallel/compat/hyperparallel/core/``)."""
import sys

from hyper_parallel.tensor_parallel import api as _home

sys.modules[__name__] = _home
