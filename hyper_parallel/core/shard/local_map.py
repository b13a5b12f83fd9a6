"""HyperParallel's module path ``hyper_parallel.core.shard.local_map``: an alias of :mod:`hyper_parallel.dispatch.local_map` (see ``hyper_parallel/compat/``)."""
import sys

from hyper_parallel.dispatch import local_map as _home

sys.modules[__name__] = _home
