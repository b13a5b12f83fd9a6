"""HyperParallel's package path ``hyper_parallel.core.utils``: the shape helpers its user code imports.

``compute_local_shape_and_global_offset`` and
``compute_local_shape_and_global_offset_by_ceil_chunk`` are provided (see ``shape_utils.py`` beside
this file, HyperParallel's ``hyper_parallel.core.utils.shape_utils``). HyperParallel's collective helpers
(``differentiable_all_reduce`` ...) and ``clip_grad_norm_`` are not: importing them raises an
``ImportError`` that names what to use instead.
"""
from .shape_utils import (
    LocalShape, compute_local_shape_and_global_offset, compute_local_shape_and_global_offset_by_ceil_chunk)

_COLLECTIVES_HINT = ("redistribute DTensors instead (DTensor.redistribute / full_tensor / to_local(grad_placements=) "
                     "plan and run differentiable collectives), or call torch.distributed / "
                     "torch.distributed.nn.functional directly for plain tensors")
_NOT_PROVIDED = {
    "clip_grad_norm_": "use torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm): it works unchanged on "
                       "DTensor parameters (exact global norm, one all_reduce per mesh dim)",
    "EXISTING_COMM_GROUPS": "process groups live on the DeviceMesh: mesh.get_group(dim) / "
                            "mesh.get_comm_group_by_axis(name)",
    "get_group_local_rank": "use mesh.get_local_rank(mesh_dim) on the DeviceMesh",
    "get_device_handle": "use torch.cuda / torch.npu (the device module of mesh.device_type) directly",
}
for _name in ("differentiable_all_gather_concat", "differentiable_all_to_all", "differentiable_all_to_all_single",
              "differentiable_all_to_all_single_async", "differentiable_all_reduce", "differentiable_reduce_scatter",
              "differentiable_variable_all_gather", "exchange_splits_via_all_to_all", "gather_counts_via_all_gather",
              "p2p_exchange", "wait_async_tensor"):
    _NOT_PROVIDED[_name] = _COLLECTIVES_HINT


def __getattr__(name):
    hint = _NOT_PROVIDED.get(name)
    if hint is not None:
        raise ImportError(f"hyper_parallel.core.utils.{name} (a HyperParallel internal helper) is not provided by "
                          f"this library: {hint}", name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # (shape_utils is imported above)


__all__ = ["LocalShape", "compute_local_shape_and_global_offset", "compute_local_shape_and_global_offset_by_ceil_chunk"]
