"""HyperParallel's package path ``hyper_parallel.core.tensor_parallel``: re-exports :mod:`hyper_parallel.tensor_parallel` (the file lives in ``hyper_parallel/compat/hyperparallel/core/``)."""
from hyper_parallel.tensor_parallel import *  # noqa: F401,F403
from hyper_parallel.compat.hyperparallel.module_paths import package_getattr
import hyper_parallel.tensor_parallel as _home
from hyper_parallel.fsdp.ddp import data_parallel, replicate  # HyperParallel's path exported these too
__all__ = getattr(_home, "__all__", [n for n in dir(_home) if not n.startswith("_")]) + ["replicate", "data_parallel"]
__getattr__ = package_getattr(__name__, _home)
