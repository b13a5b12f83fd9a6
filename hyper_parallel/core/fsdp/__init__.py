"""HyperParallel's package path ``hyper_parallel.core.fsdp``: re-exports :mod:`hyper_parallel.fsdp` (see ``hyper_parallel/compat/``)."""
from hyper_parallel.fsdp import *  # noqa: F401,F403
import hyper_parallel.fsdp as _home
__all__ = getattr(_home, "__all__", [n for n in dir(_home) if not n.startswith("_")])


def __getattr__(name):
    """A name of the home package, or one of this path's own submodules (HyperParallel's module names)."""
    try:
        return getattr(_home, name)
    except AttributeError:
        import importlib
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
