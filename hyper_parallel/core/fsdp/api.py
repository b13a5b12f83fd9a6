"""HyperParallel's module path ``hyper_parallel.core.fsdp.api``: an alias of :mod:`hyper_parallel.fsdp.api` (see ``hyper_parallel/compat/``)."""
import sys

from hyper_parallel.fsdp import api as _home

sys.modules[__name__] = _home
