"""``max(dim)`` / ``min(dim)`` over a sharded dim on HyperParallel meshes: values ``Partial(max/min)``, global indices.

HyperParallel reduces ``max(input, dim)`` locally and returns the values as
``Partial(max)`` (``Partial(min)`` for ``min``) over the mesh dims that shard
``dim``. Its indices are the local argmax of each shard; here they are the
*global* indices, ``Replicate`` over those mesh dims, computed as follows:

1. each rank takes ``max(dim, keepdim=True)`` of its shard (an empty shard gives the
   identity, -inf / +inf or the integer bound, with no index) and shifts the local
   index by its shard's global offset along ``dim``;
2. per mesh dim sharding ``dim``, one ``all_gather`` of the (value, global index)
   pairs, packed into one int64 tensor of ``2 * out.numel()`` elements (float values
   as float64 bits, exact for every float dtype; integers and bools as int64), and a
   local pair reduction: the extreme value wins, NaN beats every number (as torch
   propagates NaN), ties go to the lowest global index (the first occurrence, which
   is what ``torch.max(dim)`` returns on one process);
3. the values stay this rank's local extremes (the Partial pieces, nothing moves until
   they are read; where the winner is NaN every piece is NaN, since max/min
   all_reduces do not propagate NaN), but only the rank holding the winning index
   passes their gradient on (``where(winner, v, v.detach())``), so the gradient reaches
   exactly the element ``indices`` names, as on one process, ties across ranks included.

Cost: one all_gather of ``2 * k * out.numel()`` int64 per sharding mesh dim (``k`` its
size) in forward, nothing extra in backward. On PyTorch meshes the generic rule applies
instead (``dim`` gathered first, values and indices ``Replicate``, as in
``torch.distributed.tensor``).
"""
from __future__ import annotations

from hyper_parallel.dispatch.rules.base import Strategy
from hyper_parallel.distributed import collectives
import torch

_NO_INDEX = 2 ** 63 - 1  # index of an empty shard: loses every tie


def max_min_dim_strategy(call, lay, dim, keepdim):
    """The Strategy of ``max/min(input, dim, keepdim)`` with ``dim`` sharded (``lay`` has no Partial)."""
    op = call.name  # "max" or "min"
    shape = call.shapes[0]
    sharding = lay.dim_map[dim]
    partial = list(lay.partial)
    for md in sharding:
        partial[md] = op
    out_dm = [() if t == dim else m for t, m in enumerate(lay.dim_map) if keepdim or t != dim]
    values = lay.with_dim_map(out_dm, partial)
    indices = lay.with_dim_map(out_dm, lay.partial)
    local_fn = None
    coord = call.mesh.get_coordinate()
    if coord is not None:  # ranks outside the mesh run nothing
        offset = lay.local_shape_and_offset(shape, coord=coord)[1][dim]
        groups = [call.mesh.get_comm_group(md) for md in sharding]
        local_fn = _local_max_min(call.func, op, dim, keepdim, offset, groups)
    return Strategy([lay] + list(call.layouts[1:]), (values, indices), local_fn=local_fn)


def _identity(tensor, extremum):
    ops = torch
    if tensor.is_floating_point():
        return float("-inf") if extremum == "max" else float("inf")
    if tensor.dtype == ops.bool:
        return extremum != "max"
    info = ops.iinfo(tensor.dtype)
    return info.min if extremum == "max" else info.max


def _pack(values, global_index):
    """(value, global index) pairs as one int64 tensor of shape (1, 2, *v.shape)."""
    ops = torch
    bits = values.to(ops.float64).view(ops.int64) if values.is_floating_point() else values.to(ops.int64)
    return ops.stack([bits, global_index]).unsqueeze(0)


def _unpack(packed, floating):
    ops = torch
    vals = packed[:, 0]
    return (vals.view(ops.float64) if floating else vals), packed[:, 1]


def _best(vals, idx, extremum, floating):
    """Winning (value, index) along dim 0: extreme value (NaN first), then the lowest index."""
    ops = torch
    best = vals.amax(0) if extremum == "max" else vals.amin(0)  # amax/amin propagate NaN
    hit = vals == best
    if floating:
        hit = hit | (vals.isnan() & best.isnan())
    win = ops.where(hit, idx, ops.full_like(idx, _NO_INDEX)).amin(0)
    return best, win


def _local_max_min(func, extremum, dim, keepdim, offset, groups):
    ops, C = torch, collectives

    def local_fn(local, *args, **kwargs):
        empty = local.shape[dim] == 0
        xin = local
        if empty:  # an empty shard: one identity element along dim, kept on the autograd graph
            shape = list(local.shape)
            shape[dim] = 1
            xin = ops.full(shape, _identity(local, extremum), dtype=local.dtype, device=local.device)
            if local.requires_grad:
                xin = xin + local.sum() * 0
        res = func(xin, dim, True)
        v, i = res[0], res[1]
        gi = ops.full_like(i, _NO_INDEX) if empty else i + offset
        floating = v.is_floating_point()
        wv, wi = v.detach(), gi
        for g in groups:
            packed = C.all_gather(_pack(wv, wi), 0, g, [1] * g.size)
            vals, idx = _unpack(packed, floating)
            wv, wi = _best(vals, idx, extremum, floating)
        mine = gi == wi
        values = ops.where(mine, v, v.detach()) if v.requires_grad else v
        if floating:  # a NaN winner: every piece NaN (max/min all_reduces do not propagate NaN)
            values = ops.where(wv.isnan() & ~mine, wv.to(v.dtype), values)
        if not keepdim:
            values, wi = values.squeeze(dim), wi.squeeze(dim)
        return type(res)((values, wi))
    return local_fn


__all__ = ["max_min_dim_strategy"]
