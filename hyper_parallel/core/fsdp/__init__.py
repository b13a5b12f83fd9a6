"""HyperParallel's package path ``hyper_parallel.core.fsdp``: re-exports :mod:`hyper_parallel.fsdp` (see ``hyper_parallel/compat/``)."""
from hyper_parallel.fsdp import *  # noqa: F401,F403
import hyper_parallel.fsdp as _home
__all__ = getattr(_home, "__all__", [n for n in dir(_home) if not n.startswith("_")])


def __getattr__(name):
    return getattr(_home, name)
