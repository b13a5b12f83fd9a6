"""Data parallelism on one mesh dim: replicated parameters, gradients averaged across it.

``replicate(module, dp_mesh)`` registers a hook on every parameter that marks
its gradient for averaging over the ``dp`` group once autograd has accumulated
it; at the end of ``backward()`` all marked gradients are averaged in one flat
all_reduce per dtype (like DDP's buckets, without overlap: the collectives are
synchronous). So after ``loss.backward()`` every dp rank holds the gradient
of the global mean loss (when each rank's loss is the mean over an equal share
of the batch). Combined with tensor parallelism on another mesh dim (a
("dp", "tp") mesh), TP runs inside each dp group. Fully sharded data
parallelism is a later feature.
"""
from __future__ import annotations

from typing import TypeVar

from torch import nn

from hyper_parallel.dtensor.device_mesh import DeviceMesh, resolve_mesh
from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.distributed import deferred_grads

_Module = TypeVar("_Module", bound=nn.Module)


def replicate(module: _Module, device_mesh: DeviceMesh) -> _Module:
    """Average gradients of ``module``'s parameters over the 1-D ``device_mesh`` after backward.

    Parameters must already hold identical values on every rank of the mesh
    (true after ``parallelize_module`` with ``src_data_rank=0`` or when every rank
    builds the model from the same seed).
    """
    device_mesh = resolve_mesh(device_mesh, "replicate")
    if device_mesh.ndim != 1:
        raise ValueError(f"replicate: device_mesh must be the 1-D data-parallel mesh, got {device_mesh}")
    if getattr(module, "_hp_replicated", False):
        raise RuntimeError("replicate() was already applied to this module")
    group = device_mesh.get_comm_group(0)
    if group.size == 1:
        module.__dict__["_hp_replicated"] = True
        return module
    deferred = deferred_grads
    seen = set()
    for p in module.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        local = p._local_tensor if isinstance(p, DTensor) else p

        def hook(param, group=group, module=module):
            if module.__dict__.get("_hp_grad_sync", True):  # off: accumulate locally (pipeline microbatches)
                deferred.defer_average(param, group)
        local.register_post_accumulate_grad_hook(hook)
    module.__dict__["_hp_replicated"] = True  # a mark, not a parameter, buffer or submodule
    return module


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Whether the next backward averages ``module``'s gradients over its ``replicate`` mesh (default True).
    Off, gradients accumulate locally (gradient accumulation; a pipeline stage's microbatches before the
    last): the backward that runs with it on averages the accumulated sum once, like DDP's ``no_sync``."""
    if not getattr(module, "_hp_replicated", False):
        raise ValueError(f"set_requires_gradient_sync: {type(module).__name__} was not given to replicate()")
    module.__dict__["_hp_grad_sync"] = bool(requires_gradient_sync)


data_parallel = replicate
