"""Local-tensor helpers of ``DTensor`` (no DTensor class needed): ``to(other)``'s arguments,
the global stride of a non-contiguous shard, the empty local tensor of an off-mesh rank."""
from __future__ import annotations


def _to_like(args, kwargs):
    """``to(other, non_blocking=False, copy=False)`` spelled with ``other``'s device and dtype."""
    kwargs = dict(kwargs)
    other = kwargs.pop("other") if "other" in kwargs else args[0]
    rest = args[1:] if args and args[0] is other else args
    return (other.device, other.dtype) + tuple(rest), kwargs


def _global_stride(local, mesh, layout):
    """The global stride PyTorch gives a DTensor made from a (possibly non-contiguous) local shard.

    For each mesh dim sharding tensor dim ``d`` over ``n`` ranks, every other dim whose
    stride is at least ``d``'s is ``n`` times further apart (the shard's memory order is
    kept); for a contiguous shard this is the contiguous global stride.
    """
    stride = list(local.stride())
    for d, mesh_dims in enumerate(layout.dim_map):  # Shard and _StridedShard alike
        for md in mesh_dims:
            n = mesh.size(md)
            ref = stride[d]
            stride = [s * n if j != d and s >= ref else s for j, s in enumerate(stride)]
    return tuple(stride)


def _off_mesh_local(like, shape=None):
    """The local tensor of a rank outside a DTensor's mesh: empty (0-d zero for a 0-d DTensor), as PyTorch."""
    if shape is not None and len(shape) == 0:
        out = like.new_zeros(())
    else:
        out = like.new_empty((0,))
    if like.requires_grad and out.is_floating_point():
        out.requires_grad_(True)
    return out
