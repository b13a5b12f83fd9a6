"""HyperParallel's package path ``hyper_parallel.core.shard.ops``: re-exports :mod:`hyper_parallel.dispatch.rules` (the file lives in ``hyper_parallel/compat/hyperparallel/core/``)."""
from hyper_parallel.dispatch.rules import *  # noqa: F401,F403
from hyper_parallel.compat.hyperparallel.module_paths import package_getattr
import hyper_parallel.dispatch.rules as _home
__all__ = getattr(_home, "__all__", [n for n in dir(_home) if not n.startswith("_")])
__getattr__ = package_getattr(__name__, _home)
