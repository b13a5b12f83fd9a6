"""Differentiable collectives: one autograd Function per collective, obvious backward.

Layout collectives (used by redistribution and op rules) follow the DTensor
gradient convention: the gradient of a ``Replicate`` or ``Partial`` tensor is
one logical tensor held in full on every rank; the gradient of a ``Shard``
tensor is sharded the same way:

==========================  ==========================  ======================
function                    forward                     backward
==========================  ==========================  ======================
AllGather(split bwd)        Shard -> Replicate          take own chunk (no comm)
AllGather(rs bwd)           Shard -> Replicate          reduce_scatter
Split                       Replicate -> Shard (local)  all_gather
AllReduce                   Partial -> Replicate        sum: identity; avg: /k;
                                                        max/min: mask (x == out);
                                                        prod: g * prod of the
                                                        other ranks' x (2 all_to_all);
                                                        all/any: none (logical)
ReduceScatter               Partial -> Shard            all_gather (same rules
                                                        per op as AllReduce)
AllToAll                    Shard(i) -> Shard(j)        inverse all_to_all
ReplicateToPartial          Replicate -> Partial        identity
PartialGrad                 identity                    all_reduce(sum)
==========================  ==========================  ======================

Rooted and point-to-point collectives act on plain per-rank tensors, like
``torch.distributed.nn.functional``: every rank's output is its own tensor and
the backward is the exact adjoint of the forward (the total loss is the sum of
every rank's loss):

==========================  ==========================  ======================
Broadcast                   x of ``src`` on every rank  reduce(sum) to ``src``;
                                                        zeros elsewhere
Scatter                     piece i of ``src``'s x to   gather to ``src``;
                            rank i                      zeros elsewhere
Send / Recv (``recv``)      x to ``dst`` / from ``src`` recv / send of the gradient
==========================  ==========================  ======================

``AllGather(rs bwd)`` and ``PartialGrad`` are Megatron's pairings; they are
used where the consumer of a replicated tensor produces partial gradients
(a column-parallel matmul), so one collective serves all such consumers.
"""
from __future__ import annotations

import torch

from hyper_parallel.distributed import collectives as C


def _chunk_of(tensor, dim, sizes, idx):
    start = sum(sizes[:idx])
    return tensor.narrow(dim, start, sizes[idx])


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group, sizes, reduce_scatter_bwd):
        ctx.dim, ctx.group, ctx.sizes, ctx.rs = dim, group, sizes, reduce_scatter_bwd
        return C.all_gather(tensor, dim, group, sizes)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.rs:
            return C.reduce_scatter(grad_output, ctx.dim, ctx.group, ctx.sizes), None, None, None, None
        return _chunk_of(grad_output, ctx.dim, ctx.sizes, ctx.group.rank).contiguous(), None, None, None, None


class Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group, sizes):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return _chunk_of(tensor, dim, sizes, group.rank).contiguous()

    @staticmethod
    def backward(ctx, grad_output):
        return C.all_gather(grad_output.contiguous(), ctx.dim, ctx.group, ctx.sizes), None, None, None


def _chunk_sizes(numel, pieces):
    """torch.chunk extents of ``numel`` elements cut into ``pieces`` pieces (zeros padded in)."""
    full = -(-numel // pieces) if numel else 0
    return [max(0, min(full, numel - full * i)) for i in range(pieces)]


def _exclusive_prod(tensor):
    """Along dim 0: entry r is the product of all entries except r (prefix * suffix, no division)."""
    ones = tensor.new_ones((1,) + tuple(tensor.shape[1:]))
    pre = torch.cumprod(torch.cat([ones, tensor[:-1]], 0), 0)
    suf = torch.cumprod(torch.cat([ones, tensor.flip(0)[:-1]], 0), 0).flip(0)
    return pre * suf


def _prod_grad(flat, sizes, g_mine, group):
    """Gradient of every rank's ``flat`` (1, N) under an elementwise product over ``group``.

    Piece c (``sizes[c]`` elements) of every rank's ``flat`` is sent to rank c
    (one all_to_all), which multiplies its gradient piece ``g_mine`` by the
    product of the other ranks' values and sends each rank its share back (a
    second all_to_all). Exact with zeros; moves 2 * N * (k-1)/k elements per rank.
    """
    k = group.size
    ones = [1] * k
    mine = C.all_to_all(flat, 1, 0, group, sizes, ones)          # (k, sizes[me]): row r = rank r's piece
    contrib = _exclusive_prod(mine) * g_mine.reshape(1, -1)
    return C.all_to_all(contrib, 0, 1, group, ones, sizes)      # (1, N)


def _hit(tensor, out):
    """Where a piece ``tensor`` equals the max/min ``out`` (a NaN piece matches a NaN result)."""
    hit = tensor == out
    return hit | (tensor.isnan() & out.isnan()) if tensor.is_floating_point() else hit


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, reduction):
        out = C.all_reduce(tensor, group, reduction)
        ctx.op, ctx.group = reduction, group
        if reduction in ("max", "min"):
            ctx.save_for_backward(tensor, out)
        elif reduction == "prod":
            ctx.save_for_backward(tensor)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        op, group = ctx.op, ctx.group
        if op == "sum" or group.size == 1:
            return grad_output, None, None
        if op in ("all", "any"):  # logical reductions are piecewise constant: no gradient
            return None, None, None
        if op == "avg":
            return grad_output / group.size, None, None
        if op == "prod":
            (x,) = ctx.saved_tensors
            n = x.numel()
            sizes = _chunk_sizes(n, group.size)
            start = sum(sizes[:group.rank])
            g_mine = grad_output.reshape(-1)[start:start + sizes[group.rank]]
            return _prod_grad(x.reshape(1, n), sizes, g_mine, group).view(x.shape), None, None
        x, out = ctx.saved_tensors
        return grad_output * _hit(x, out).to(grad_output.dtype), None, None


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group, sizes, reduction):
        C.reduce_op(reduction)  # validates op
        ctx.dim, ctx.group, ctx.sizes, ctx.op = dim, group, sizes, reduction
        out = C.reduce_scatter(tensor, dim, group, sizes, reduction)
        if reduction in ("max", "min"):
            ctx.save_for_backward(tensor, out)
        elif reduction == "prod":
            ctx.save_for_backward(tensor)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        dim, group, sizes, op = ctx.dim, ctx.group, ctx.sizes, ctx.op
        if op in ("all", "any"):
            return None, None, None, None, None
        if op in ("sum", "avg") or group.size == 1:
            full = C.all_gather(grad_output.contiguous(), dim, group, sizes)
            return (full / group.size if op == "avg" else full), None, None, None, None
        if op == "prod":
            (x,) = ctx.saved_tensors
            xt = x.movedim(dim, 0).contiguous()
            rest = xt.numel() // xt.shape[0] if xt.shape[0] else 0
            grad = _prod_grad(xt.reshape(1, -1), [s * rest for s in sizes], grad_output.movedim(dim, 0).contiguous(),
                              group)
            return grad.view(xt.shape).movedim(0, dim).contiguous(), None, None, None, None
        # max / min: gather the gradient and the reduced values in one all_gather, then mask
        x, out = ctx.saved_tensors
        both = C.all_gather(torch.stack([grad_output.to(out.dtype), out]), dim + 1, group, sizes)
        return both[0] * _hit(x, both[1]).to(grad_output.dtype), None, None, None, None


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, split_dim, cat_dim, group, split_sizes, cat_sizes):
        ctx.args = (split_dim, cat_dim, group, split_sizes, cat_sizes)
        return C.all_to_all(tensor, split_dim, cat_dim, group, split_sizes, cat_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        split_dim, cat_dim, group, split_sizes, cat_sizes = ctx.args
        return (C.all_to_all(grad_output.contiguous(), cat_dim, split_dim, group, cat_sizes, split_sizes),
                None, None, None, None, None)


class ReplicateToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, reduction):
        if reduction in ("sum",) and group.rank != 0:
            return torch.zeros_like(tensor)
        if reduction == "prod" and group.rank != 0:
            return torch.ones_like(tensor)
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None


class PartialGrad(torch.autograd.Function):
    """Identity forward; all_reduce(sum) of the gradient (Megatron's copy-to-region).

    The output is a view of a detached alias of ``x``, not of ``x`` itself: callers cache the output on
    ``x`` (one all_reduce however many consumers), and a view of ``x`` would hold ``x`` through its C++
    ``_base``, a cycle ``x -> cache -> output -> x`` that Python's collector cannot see, keeping every
    step's activations alive.
    """

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.detach().view_as(tensor)

    @staticmethod
    def backward(ctx, grad_output):
        return C.all_reduce(grad_output, ctx.group, "sum"), None


class GatheredPartialGrad(torch.autograd.Function):
    """Return an already-gathered tensor whose gradient is reduce-scattered to ``x``.

    Used to give consumers that produce partial gradients a second autograd path
    out of one all_gather: forward costs nothing, backward is one reduce_scatter.
    """

    @staticmethod
    def forward(ctx, tensor, gathered, dim, group, sizes):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad_output):
        return C.reduce_scatter(grad_output.contiguous(), ctx.dim, ctx.group, ctx.sizes), None, None, None, None


class WithValue(torch.autograd.Function):
    """Return ``value`` (same shape as ``x``) with an identity gradient to ``x``.

    Used to replace a tensor's data by data received from another rank while
    the result stays on ``x``'s autograd path (``from_local(run_check=True)``).
    """

    @staticmethod
    def forward(ctx, tensor, value):
        if tuple(value.shape) != tuple(tensor.shape):
            raise ValueError(f"WithValue: value shape {tuple(value.shape)} differs from tensor shape {tuple(tensor.shape)}")
        return value.detach().clone() if value.data_ptr() == tensor.data_ptr() else value.detach()

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


# ----------------------------------------------------------------------------- rooted and point-to-point
class Broadcast(torch.autograd.Function):
    """Every rank gets global rank ``src``'s ``x``.

    The other ranks pass a tensor of the same shape and dtype (its values are
    ignored). Backward: the sum of every rank's gradient lands on ``src``
    (one reduce); the other ranks' inputs get zeros.
    """

    @staticmethod
    def forward(ctx, tensor, group, src):
        ctx.group, ctx.src = group, src
        out = C.broadcast(tensor, group, src)
        return tensor.view_as(tensor) if out is tensor else out

    @staticmethod
    def backward(ctx, grad_output):
        total = C.reduce(grad_output.contiguous(), ctx.group, ctx.src, "sum")
        if ctx.group.size == 1 or ctx.group.ranks[ctx.group.rank] == ctx.src:
            return total, None, None
        return torch.zeros_like(grad_output), None, None


class Scatter(torch.autograd.Function):
    """Cut global rank ``src``'s ``x`` along ``dim`` into ``sizes`` and give piece i to group rank i.

    ``sizes`` defaults to ``torch.chunk`` extents. Every rank passes a tensor of
    the full shape (only ``src``'s values are read). Backward: the pieces'
    gradients are gathered onto ``src``; the other ranks' inputs get zeros.
    """

    @staticmethod
    def forward(ctx, tensor, dim, group, src, sizes=None):
        if sizes is None:
            sizes = _chunk_sizes(tensor.shape[dim], group.size)
        if len(sizes) != group.size or sum(sizes) != tensor.shape[dim]:
            raise ValueError(f"Scatter: sizes={list(sizes)} must have {group.size} entries summing to "
                             f"x.shape[{dim}]={tensor.shape[dim]}")
        ctx.dim, ctx.group, ctx.src, ctx.sizes = dim, group, src, tuple(sizes)
        if group.size == 1:
            return tensor.view_as(tensor)
        return C.split_scatter(tensor, dim, group, src, sizes)

    @staticmethod
    def backward(ctx, grad_output):
        full = C.gather(grad_output.contiguous(), ctx.dim, ctx.group, ctx.src, ctx.sizes)
        if full is None:  # not the source: the input was never read
            shape = list(grad_output.shape)
            shape[ctx.dim] = sum(ctx.sizes)
            full = grad_output.new_zeros(shape)
        return full, None, None, None, None


class Send(torch.autograd.Function):
    """Send ``x`` to global rank ``dst``; returns a 0-d zero token that carries the graph.

    Backward (run it with ``token.backward()`` or by adding the token to the
    loss): receive the gradient of ``x`` from ``dst``, where the matching
    :class:`Recv` sends it. Every differentiable send needs that backward, or
    the receiver's backward waits forever.
    """

    @staticmethod
    def forward(ctx, tensor, dst, group=None):
        ctx.dst, ctx.group = dst, group
        ctx.meta = (tuple(tensor.shape), tensor.dtype, tensor.device)
        C.send(tensor, dst, group)
        return tensor.new_zeros(())

    @staticmethod
    def backward(ctx, _token_grad):
        shape, dtype, device = ctx.meta
        return C.recv(torch.empty(shape, dtype=dtype, device=device), ctx.dst, ctx.group), None, None


class Recv(torch.autograd.Function):
    """Receive a tensor of ``shape`` from global rank ``src``; backward sends its gradient back to ``src``.

    ``anchor`` gives dtype and device, and the output requires grad when it
    does (use :func:`recv`, which makes a 0-element anchor).
    """

    @staticmethod
    def forward(ctx, anchor, src, shape, group=None):
        ctx.src, ctx.group = src, group
        return C.recv(anchor.new_empty(tuple(shape)), src, group)

    @staticmethod
    def backward(ctx, grad_output):
        C.send(grad_output.contiguous(), ctx.src, ctx.group)
        return None, None, None, None


def send(tensor, dst, group=None):
    """Differentiable send (see :class:`Send`); returns the token to run backward through."""
    return Send.apply(tensor, dst, group)


def recv(shape, src, group=None, *, dtype=None, device=None, requires_grad=True):
    """Differentiable receive of a ``shape`` tensor from ``src`` (see :class:`Recv`)."""
    anchor = torch.empty(0, dtype=dtype, device=device, requires_grad=requires_grad)
    return Recv.apply(anchor, src, tuple(shape), group)


# Cross-mesh point-to-point exchange (its own file; re-exported so the core reaches it as functions.*).
from hyper_parallel.distributed.p2p import CrossMeshExchange  # noqa: E402,F401
