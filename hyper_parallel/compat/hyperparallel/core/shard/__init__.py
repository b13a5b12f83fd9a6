"""HyperParallel's package path ``hyper_parallel.core.shard``: re-exports :mod:`hyper_parallel.dispatch` (the file lives in ``hyper_parallel/compat/hyperparallel/core/``)."""
from hyper_parallel.dispatch import *  # noqa: F401,F403
from hyper_parallel.compat.hyperparallel.module_paths import package_getattr
import hyper_parallel.dispatch as _home
__all__ = getattr(_home, "__all__", [n for n in dir(_home) if not n.startswith("_")])
__getattr__ = package_getattr(__name__, _home)
