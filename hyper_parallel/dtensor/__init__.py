"""HyperParallel's ``hyper_parallel.dtensor`` package: its public names, resolved lazily.

``from hyper_parallel.dtensor import DTensor, Layout, distribute_tensor`` gives the same
objects as ``hyper_parallel.DTensor`` ... (never copies). The names are looked up on first
use (module ``__getattr__``) so that importing a submodule such as
``hyper_parallel.dtensor.layout`` on its own does not pull in the DTensor class or the
op dispatcher (no import cycles); ``CommDebugMode`` (a higher layer) is handed over by
``hyper_parallel.debug`` (:func:`register_export`).
"""
from importlib import import_module as _import_module

# public name -> module that defines it
_EXPORTS = {
    "DTensor": "hyper_parallel.dtensor.dtensor",
    "Layout": "hyper_parallel.dtensor.layout",
    "DeviceMesh": "hyper_parallel.dtensor.device_mesh",
    "init_device_mesh": "hyper_parallel.dtensor.device_mesh",
    "Placement": "hyper_parallel.dtensor.placement_types",
    "Shard": "hyper_parallel.dtensor.placement_types",
    "Replicate": "hyper_parallel.dtensor.placement_types",
    "Partial": "hyper_parallel.dtensor.placement_types",
    "distribute_tensor": "hyper_parallel.dtensor.api",
    "distribute_module": "hyper_parallel.dtensor.api",
    "ones": "hyper_parallel.dtensor.api",
    "zeros": "hyper_parallel.dtensor.api",
    "empty": "hyper_parallel.dtensor.api",
    "full": "hyper_parallel.dtensor.api",
    "rand": "hyper_parallel.dtensor.api",
    "randn": "hyper_parallel.dtensor.api",
    "manual_seed": "hyper_parallel.dtensor.random",
}
# names that higher layers hand over (register_export): CommDebugMode from hyper_parallel.debug
_PROVIDED: dict = {}

__all__ = sorted(set(_EXPORTS) | {"CommDebugMode"})


def register_export(name: str, value) -> None:
    """Make ``value`` importable as ``hyper_parallel.dtensor.<name>`` (HyperParallel's path).

    For objects of higher layers that this package must not import (``CommDebugMode``:
    ``hyper_parallel.debug`` registers it when it is imported, as the package root does).
    """
    if name not in __all__:
        raise ValueError(f"register_export: {name!r} is not one of hyper_parallel.dtensor's names {__all__}")
    _PROVIDED[name] = value


def __getattr__(name):
    if name in _PROVIDED:
        return _PROVIDED[name]
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
