"""The DTensor core: mesh, placements, layout math, the pure planners, the DTensor class and its API.

Design (one screen)
-------------------
* **A storage-less wrapper.** ``dtensor.py``: ``DTensor`` is a ``torch.Tensor`` wrapper subclass with
  the global shape that holds this rank's local tensor; autograd records the local computation, so
  backward has no DTensor work per op. Its torch entry points are defined once and delegate to the
  op dispatcher object (``dispatch/dispatcher.py``, handed over with ``set_dispatcher``).
* **Layout math is pure.** ``placement_types.py`` (``Shard``/``Replicate``/``Partial``, torch's
  semantics), ``layout_math.py`` (the immutable ``LayoutMath``: per tensor dim the mesh dims sharding
  it, per mesh dim a pending reduction; HyperParallel's alias spelling), ``strided_math.py``,
  ``mesh_coords.py``: no torch, directly or indirectly. ``layout.py`` (``Layout``: the math plus its
  mesh), ``layout_builder.py``, ``device_mesh.py`` (``DeviceMesh``, both libraries'
  ``init_device_mesh``, torch meshes adopted) sit on top. The planners ``redistribute_plan.py`` (Dijkstra over layout states, minimum
  bytes) and ``cross_mesh_plan.py`` are pure functions of layouts and shapes: no torch (the
  ``pure-math`` import contract), so they are tested without processes.
* **Executors.** ``redistribute.py`` (runs a plan with the ground floor's differentiable collectives,
  partial-gradient views), ``cross_mesh.py``, ``run_check.py`` (``from_local(run_check=True)``),
  ``random.py`` (layout-independent random streams), ``api.py`` (``distribute_tensor``,
  ``distribute_module``, factories), ``grad_state.py`` / ``partial_grad_seed.py`` (Partial gradients),
  ``function_bridge.py`` (``autograd.Function`` on DTensors), ``special_methods.py`` (``detach``,
  ``backward``, ``item``...), ``skip_and_replication.py`` (``SkipDTensorDispatch``, ``implicit_replication``),
  ``cache_key.py`` (the interned (layout, shape) token the dispatcher's cache keys use).
* **Torch patches owned here** (each listed with its reason in docs/design.md): ``patch_function_apply.py``,
  ``patch_testing.py``, ``vmap_bridge.py``; ``torch_internals.py`` names the few private torch APIs used.
* **Imports.** The ground floor, ``compile``, ``checkpoint.dcp`` (first use), and HyperParallel's mixins
  in ``compat/``; nothing above. This package's public names resolve lazily (module ``__getattr__``), so
  importing ``dtensor.layout`` alone does not pull in the class; ``CommDebugMode`` is handed over by
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
    # private, but HyperParallel's shard tests import it from its package path (`from hyper_parallel.core.dtensor
    # import _build_layout, distribute_tensor`): a Layout from (mesh, placements, tensor ndim)
    "_build_layout": "hyper_parallel.dtensor.dtensor",
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
