"""Differentiable collectives: one autograd Function per collective, obvious backward.

Backward rules follow the DTensor gradient convention (the gradient of a
``Replicate`` or ``Partial`` tensor is held in full on every rank; the gradient
of a ``Shard`` tensor is sharded the same way):

==========================  ==========================  ======================
function                    forward                     backward
==========================  ==========================  ======================
AllGather(split bwd)        Shard -> Replicate          take own chunk (no comm)
AllGather(rs bwd)           Shard -> Replicate          reduce_scatter
Split                       Replicate -> Shard (local)  all_gather
AllReduce                   Partial -> Replicate        identity (avg: /k, max/min: mask)
ReduceScatter               Partial -> Shard            all_gather
AllToAll                    Shard(i) -> Shard(j)        inverse all_to_all
ReplicateToPartial          Replicate -> Partial        identity
PartialGrad                 identity                    all_reduce(sum)
==========================  ==========================  ======================

``AllGather(rs bwd)`` and ``PartialGrad`` are Megatron's pairings; they are
used where the consumer of a replicated tensor produces partial gradients
(a column-parallel matmul), so one collective serves all such consumers.
"""
from __future__ import annotations

import torch

from hyper_parallel.platform.torch import collectives as C


def _chunk_of(x, dim, sizes, idx):
    start = sum(sizes[:idx])
    return x.narrow(dim, start, sizes[idx])


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes, reduce_scatter_bwd):
        ctx.dim, ctx.group, ctx.sizes, ctx.rs = dim, group, sizes, reduce_scatter_bwd
        return C.all_gather(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, g):
        if ctx.rs:
            return C.reduce_scatter(g, ctx.dim, ctx.group, ctx.sizes), None, None, None, None
        return _chunk_of(g, ctx.dim, ctx.sizes, ctx.group.rank).contiguous(), None, None, None, None


class Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return _chunk_of(x, dim, sizes, group.rank).contiguous()

    @staticmethod
    def backward(ctx, g):
        return C.all_gather(g.contiguous(), ctx.dim, ctx.group, ctx.sizes), None, None, None


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, op):
        out = C.all_reduce(x, group, op)
        ctx.op, ctx.k = op, group.size
        if op in ("max", "min", "prod"):
            ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, g):
        op = ctx.op
        if op == "sum":
            return g, None, None
        if op == "avg":
            return g / ctx.k, None, None
        x, out = ctx.saved_tensors
        if op == "prod":
            return g * out / x, None, None
        return g * (x == out).to(g.dtype), None, None


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes, op):
        if op not in ("sum", "avg"):
            raise ValueError(f"ReduceScatter supports op 'sum' or 'avg', got {op!r}")
        ctx.dim, ctx.group, ctx.sizes, ctx.op = dim, group, sizes, op
        return C.reduce_scatter(x, dim, group, sizes, op)

    @staticmethod
    def backward(ctx, g):
        full = C.all_gather(g.contiguous(), ctx.dim, ctx.group, ctx.sizes)
        if ctx.op == "avg":
            full = full / ctx.group.size
        return full, None, None, None, None


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, group, split_sizes, cat_sizes):
        ctx.args = (split_dim, cat_dim, group, split_sizes, cat_sizes)
        return C.all_to_all(x, split_dim, cat_dim, group, split_sizes, cat_sizes)

    @staticmethod
    def backward(ctx, g):
        split_dim, cat_dim, group, split_sizes, cat_sizes = ctx.args
        return (C.all_to_all(g.contiguous(), cat_dim, split_dim, group, cat_sizes, split_sizes),
                None, None, None, None, None)


class ReplicateToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, op):
        if op in ("sum",) and group.rank != 0:
            return torch.zeros_like(x)
        if op == "prod" and group.rank != 0:
            return torch.ones_like(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class PartialGrad(torch.autograd.Function):
    """Identity forward; all_reduce(sum) of the gradient (Megatron's copy-to-region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return C.all_reduce(g, ctx.group, "sum"), None


class GatheredPartialGrad(torch.autograd.Function):
    """Return an already-gathered tensor whose gradient is reduce-scattered to ``x``.

    Used to give consumers that produce partial gradients a second autograd path
    out of one all_gather: forward costs nothing, backward is one reduce_scatter.
    """

    @staticmethod
    def forward(ctx, x, gathered, dim, group, sizes):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, g):
        return C.reduce_scatter(g.contiguous(), ctx.dim, ctx.group, ctx.sizes), None, None, None, None
