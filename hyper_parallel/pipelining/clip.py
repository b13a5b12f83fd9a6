"""``clip_grad_norm_`` over a whole pipeline: every stage's gradients, on every pipeline rank.

``torch.nn.utils.clip_grad_norm_`` on one rank of a pipeline sees only that rank's stages, so
each rank would clip with its own norm. Here each rank computes the ``norm_type`` norm of its
own gradients (torch's ``get_total_norm``; DTensor gradients of FSDP/TP are reduced over their
own mesh by the sharded ``_foreach_norm``), the pipeline ranks combine those partial norms with
one all_reduce over ``pp_group`` (sum of ``norm ** p``; max for ``inf``), and every rank scales
its gradients by ``max_norm / (total + 1e-6)`` (clamped to 1) with torch's
``clip_grads_with_norm_``.

Gradients on different meshes (e.g. plain gradients next to DTensor ones) are normed per mesh
first, so torch never stacks norms of different meshes.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.dtensor import DTensor

__all__ = ["clip_grad_norm_", "get_total_norm"]


def _local(tensor):
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _group(pp_group):
    if pp_group is None:
        return None
    if isinstance(pp_group, DeviceMesh):
        if pp_group.ndim != 1:
            raise ValueError(f"clip_grad_norm_: pp_group must be a ProcessGroup or a 1-D DeviceMesh (the pipeline "
                             f"mesh dim), got a {pp_group.ndim}-D mesh {pp_group}")
        return pp_group.get_group()
    if not isinstance(pp_group, dist.ProcessGroup):
        raise ValueError(f"clip_grad_norm_: pp_group must be a ProcessGroup, a 1-D DeviceMesh or None, "
                         f"got {pp_group!r}")
    return pp_group


def _norm_type(norm_type):
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"clip_grad_norm_: norm_type must be a number or 'inf', got {norm_type!r}") from None
    if math.isnan(p) or p <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 (or inf), got {norm_type!r}")
    return p


def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None, *, pp_group=None):
    """The ``norm_type`` norm of ``tensors`` on every pipeline rank of ``pp_group`` together (a plain 0-d tensor,
    the same on every rank of the group)."""
    p = _norm_type(norm_type)
    group = _group(pp_group)
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = [t for t in tensors if t is not None]
    by_mesh = {}
    for t in tensors:
        by_mesh.setdefault(id(t.device_mesh) if isinstance(t, DTensor) else None, []).append(t)
    device = _local(tensors[0]).device if tensors else None
    dtype = _local(tensors[0]).dtype if tensors else torch.float32
    parts = []
    for ts in by_mesh.values():
        n = torch.nn.utils.get_total_norm(ts, p, error_if_nonfinite=False, foreach=foreach)
        parts.append((n.full_tensor() if isinstance(n, DTensor) else n).to(dtype))
    if device is None:  # no gradient on this rank: contribute 0 on the group's device
        device = torch.device("cpu")
        if group is not None and dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
    local = torch.stack([x.to(device) for x in parts]) if parts else torch.zeros(0, dtype=dtype, device=device)
    if math.isinf(p):
        total = local.max() if local.numel() else torch.zeros((), dtype=dtype, device=device)
        if group is not None:
            total = total.clone()
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = local.pow(p).sum()
        if group is not None:
            dist.all_reduce(total, group=group)
        total = total.pow(1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients over the "
                           "pipeline is non-finite, so it cannot be clipped; set error_if_nonfinite=False to "
                           "clip anyway (the gradients become nan/inf)")
    return total


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, *,
                    pp_group=None):
    """torch's ``clip_grad_norm_`` with the norm taken over all pipeline stages: returns the total norm."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    try:
        max_norm = float(max_norm)
    except (TypeError, ValueError):
        raise ValueError(f"clip_grad_norm_: max_norm must be a number, got {max_norm!r}") from None
    grads = [q.grad for q in params if q.grad is not None]
    total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach, pp_group=pp_group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        with torch.no_grad():
            for g in grads:
                g.mul_(coef.to(_local(g).device, _local(g).dtype))
    return total
