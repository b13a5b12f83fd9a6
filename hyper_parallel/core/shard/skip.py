"""HyperParallel's module path ``hyper_parallel.core.shard.skip``: an alias of :mod:`hyper_parallel.compat.hp_skip` (see ``hyper_parallel/compat/``)."""
import sys

from hyper_parallel.compat import hp_skip as _home

sys.modules[__name__] = _home
