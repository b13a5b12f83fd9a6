"""Local data of residual ``_StridedShard`` layouts: cutting a full tensor, gathering it back.

A residual strided layout (``Layout.strided``; see ``strided_math``) holds pieces
that are not one box of the tensor, so the box-based redistribution planner does
not apply. Its data moves the way PyTorch moves it: to the full tensor by one
all-gather per sharded mesh dim, last mesh dim first, with the gathered strided
chunks put back in order (``_StridedShard._to_replicate_tensor``); from the full
tensor by selecting this rank's indices. Both are differentiable.
"""
from __future__ import annotations

import torch

from hyper_parallel.distributed import differentiable
from hyper_parallel.dtensor import strided_math
from hyper_parallel.dtensor.placement_types import Shard, _StridedShard


def _select(tensor: torch.Tensor, dim: int, idx) -> torch.Tensor:
    if idx and idx == list(range(idx[0], idx[0] + len(idx))):
        return tensor.narrow(dim, idx[0], len(idx))
    return tensor.index_select(dim, torch.tensor(idx, dtype=torch.long, device=tensor.device))


def slice_strided(full: torch.Tensor, layout, coord) -> torch.Tensor:
    """The piece of ``full`` held at mesh coordinate ``coord`` under ``layout`` (PyTorch's rules)."""
    held = strided_math.torch_local_indices(tuple(full.shape), layout.mesh_shape, layout.placements, coord)
    out = full
    for t, idx in enumerate(held):
        if idx is not None:
            out = _select(out, t, idx)
    return out.contiguous() if out is not full else out.clone()


def gather_strided(local: torch.Tensor, layout, global_shape, mesh) -> torch.Tensor:
    """The full tensor on every rank of ``mesh`` from this rank's piece under the strided ``layout``.

    Pending ``Partial`` mesh dims are left as they are (the result is replicated on
    the sharded mesh dims only).
    """
    placements = layout.placements
    coord = mesh.get_coordinate()
    x = local
    for d in range(len(placements) - 1, -1, -1):
        p = placements[d]
        if not isinstance(p, (Shard, _StridedShard)) or layout.mesh_shape[d] == 1:
            continue
        t = p.dim % len(global_shape)
        before = strided_math.torch_local_indices(global_shape, layout.mesh_shape, placements[:d], coord)[t]
        size = global_shape[t] if before is None else len(before)
        n = layout.mesh_shape[d]
        if isinstance(p, _StridedShard):
            pieces = p.strided_indices(size, n)
        else:
            pieces = [list(range(*strided_math._chunk(size, n, r))) for r in range(n)]
        sizes = [len(i) for i in pieces]
        x = differentiable.AllGather.apply(x.contiguous(), t, mesh.get_comm_group(d), sizes, False)
        order = [i for piece in pieces for i in piece]
        if order != list(range(size)):
            inverse = [0] * size
            for pos, i in enumerate(order):
                inverse[i] = pos
            x = _select(x, t, inverse)
    return x


__all__ = ["slice_strided", "gather_strided"]
