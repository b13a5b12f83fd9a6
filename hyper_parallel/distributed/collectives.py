"""Raw (non-differentiable) collectives on plain torch tensors.

Each function takes a :class:`CommGroup`, issues exactly one ``torch.distributed``
call, reports it to :mod:`hyper_parallel.distributed.comm_record`, and returns a new
tensor. Uneven shards are handled here (padding for all_gather/reduce_scatter,
uneven splits for all_to_all) so callers can think in ``torch.chunk`` terms.

Every ``torch.distributed`` call is wrapped: torch's ``RuntimeError`` (dead peer, timeout) becomes a
``CollectiveError`` naming the collective, the group and its mesh dims (``fault.py``); with
the desync check on (``faults.CHECK``) the ranks compare the collective's description first.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from hyper_parallel.distributed import comm_record as rec
from hyper_parallel.distributed.collective_errors import CHECK as _CHECK
from hyper_parallel.distributed import collective_guard as _fault
from hyper_parallel.distributed import traced_collectives as _traced
from hyper_parallel.distributed import uneven_padding as wire

# True while torch.compile traces (dynamo, fake propagation, AOTAutograd): collectives must then be
# the traceable functional ones (see compile_collectives); never true in eager code
_tracing = torch.compiler.is_compiling

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
    "all": dist.ReduceOp.MIN,   # logical and: min of (x != 0), see _wire
    "any": dist.ReduceOp.MAX,   # logical or: max of (x != 0)
}


# torch >= 2.13 renamed the single-tensor variants; keep working on older releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_op(name: str):
    try:
        return _REDUCE_OPS[name]
    except KeyError:
        raise ValueError(f"reduce_op={name!r} is not supported; expected one of {sorted(_REDUCE_OPS)}") from None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, group, reduction: str = "sum", what: str = "all_reduce") -> torch.Tensor:
    """Return the reduction of ``tensor`` over ``group`` (``tensor`` itself is not modified).

    ``what`` names the collective in error messages (e.g. the deferred gradients' all_reduce).
    """
    if _tracing() and group.size > 1:
        return _traced.all_reduce(tensor, group, reduction)
    if group.size == 1:
        return tensor
    tensor, reduction, back = wire.logical(tensor, reduction)
    out = tensor.contiguous().clone()
    rec.record(rec.ALL_REDUCE, _nbytes(out), group.ranks)
    if reduction == "avg" and not out.is_floating_point():
        raise TypeError(f"all_reduce(op='avg') needs a floating dtype, got {out.dtype}")
    if _CHECK[0]:
        _fault.check(what, group, out, f"op {reduction}")
    try:
        dist.all_reduce(out, op=reduce_op(reduction), group=group.handle)
    except RuntimeError as exc:
        _fault.fail(what, group, exc)
    return out if back is None else out.to(back)


_GLOO_WIDER = {torch.bool: torch.uint8, torch.int16: torch.int32}


def all_gather(tensor: torch.Tensor, dim: int, group, sizes: Sequence[int] = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``.

    ``sizes[i]`` is rank i's extent along ``dim`` (torch.chunk rules may make them
    uneven, or zero); shorter pieces are padded for the wire and trimmed after.
    """
    if _tracing() and group.size > 1:
        return _traced.all_gather(tensor, dim, group, sizes)
    k = group.size
    if k == 1:
        return tensor
    wide = _GLOO_WIDER.get(tensor.dtype)
    if wide is not None:  # gloo has no bool/int16 all_gather ("Invalid scalar type"): a lossless wider dtype
        return all_gather(tensor.to(wide), dim, group, sizes).to(tensor.dtype)
    if sizes is None:
        sizes = [tensor.shape[dim]] * k
    m = max(sizes)
    even = all(s == m for s in sizes)
    if dim == 0:
        xt = wire.pad_dim(tensor, 0, m).contiguous()
        buf = xt.new_empty((k * m,) + tuple(xt.shape[1:]))
        rec.record(rec.ALL_GATHER, _nbytes(xt), group.ranks)
        if _CHECK[0]:
            _fault.check("all_gather", group, xt, f"dim 0, sizes {list(sizes)}")
        try:
            _all_gather_single(buf, xt, group=group.handle)
        except RuntimeError as exc:
            _fault.fail("all_gather", group, exc)
        return buf if even else torch.cat([buf[i * m:i * m + s] for i, s in enumerate(sizes)], dim=0)
    # other dims: gather whole (padded) pieces, then one cat along dim
    if tensor.shape[dim] < m:
        pad_shape = list(tensor.shape)
        pad_shape[dim] = m - tensor.shape[dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
    xt = tensor.contiguous()
    # the wire format is dim-0 concatenation; view it as (k, *piece) afterwards
    buf = xt.new_empty((k * xt.shape[0],) + tuple(xt.shape[1:]))
    rec.record(rec.ALL_GATHER, _nbytes(xt), group.ranks)
    if _CHECK[0]:
        _fault.check("all_gather", group, xt, f"dim {dim}, sizes {list(sizes)}")
    try:
        _all_gather_single(buf, xt, group=group.handle)
    except RuntimeError as exc:
        _fault.fail("all_gather", group, exc)
    buf = buf.view((k,) + tuple(xt.shape))
    return torch.cat([buf[i] if even else buf[i].narrow(dim, 0, s) for i, s in enumerate(sizes)], dim=dim)


def reduce_scatter(tensor: torch.Tensor, dim: int, group, sizes: Sequence[int] = None,
                   reduction: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` and keep this rank's piece along ``dim``.

    ``sizes`` are the per-rank piece sizes along ``dim`` (sum = ``tensor.shape[dim]``).
    """
    if _tracing() and group.size > 1:
        return _traced.reduce_scatter(tensor, dim, group, sizes, reduction)
    k = group.size
    if k == 1:
        return tensor
    tensor, reduction, back = wire.logical(tensor, reduction)
    sizes = wire.reduce_scatter_sizes(tensor, dim, k, sizes)
    inp = wire.reduce_scatter_input(tensor, dim, sizes)
    out = inp.new_empty((max(sizes),) + tuple(inp.shape[1:]))
    rec.record(rec.REDUCE_SCATTER, _nbytes(inp), group.ranks)
    if _CHECK[0]:
        _fault.check("reduce_scatter", group, inp, f"dim {dim}, sizes {list(sizes)}, op {reduction}")
    try:
        if reduction == "avg":
            _reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group.handle)
            out = out / k
        else:
            _reduce_scatter_single(out, inp, op=reduce_op(reduction), group=group.handle)
    except RuntimeError as exc:
        _fault.fail("reduce_scatter", group, exc)
    out = wire.reduce_scatter_output(out, dim, sizes[group.rank])
    return out if back is None else out.to(back)


def all_to_all(tensor: torch.Tensor, split_dim: int, cat_dim: int, group,
               split_sizes: Sequence[int], cat_sizes: Sequence[int]) -> torch.Tensor:
    """Shard(cat_dim) -> Shard(split_dim) exchange with one ``all_to_all_single``.

    ``tensor`` holds this rank's piece along ``cat_dim`` (``cat_sizes[me]``) and the
    full extent along ``split_dim``; it is cut along ``split_dim`` into
    ``split_sizes`` (rank i receives piece i) and the received pieces are joined
    along ``cat_dim``. Uneven sizes are sent with uneven splits (no padding).
    """
    if _tracing() and group.size > 1:
        return _traced.all_to_all(tensor, split_dim, cat_dim, group, split_sizes, cat_sizes)
    k = group.size
    if k == 1:
        return tensor
    me = group.rank
    send, in_splits, out_splits = wire.all_to_all_pack(tensor, split_dim, cat_dim, split_sizes, cat_sizes, me)
    recv = tensor.new_empty(sum(out_splits))
    esz = tensor.element_size()
    rec.record(rec.ALL_TO_ALL, _nbytes(send), group.ranks, sent=(sum(in_splits) - in_splits[me]) * esz)
    if _CHECK[0]:  # the local pieces differ per rank: compare the global split, not the local shape
        _fault.check("all_to_all", group, tensor, f"split dim {split_dim} sizes {list(split_sizes)}, cat dim {cat_dim} "
                     f"sizes {list(cat_sizes)}, other dims "
                     f"{[s for d, s in enumerate(tensor.shape) if d not in (split_dim, cat_dim)]}",
                     shape=False)
    try:
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=group.handle)
    except RuntimeError as exc:
        _fault.fail("all_to_all", group, exc)
    return wire.all_to_all_unpack(recv, tensor.shape, split_dim, cat_dim, split_sizes, cat_sizes, me, out_splits)


def broadcast(tensor: torch.Tensor, group, src: int) -> torch.Tensor:
    """Broadcast from global rank ``src`` (in ``group``); returns the received tensor."""
    if group.size == 1:
        return tensor
    out = tensor.contiguous()
    me_src = dist.get_rank() == src
    if not me_src:
        out = out.clone()
    rec.record(rec.BROADCAST, _nbytes(out), group.ranks, is_src=me_src)
    if _CHECK[0]:
        _fault.check("broadcast", group, out, f"src {src}")
    try:
        dist.broadcast(out, src=src, group=group.handle)
    except RuntimeError as exc:
        _fault.fail("broadcast", group, exc, peer=None if me_src else src)
    return out


def scatter(out: torch.Tensor, chunks, group, src: int) -> torch.Tensor:
    """Scatter ``chunks`` (list of equal-shape tensors, only read on ``src``) into ``out``."""
    if group.size == 1:
        out.copy_(chunks[0])
        return out
    me_src = dist.get_rank() == src
    total = sum(_nbytes(c) for c in chunks) if me_src else 0
    rec.record(rec.SCATTER, total, group.ranks, is_src=me_src)
    if _CHECK[0]:
        _fault.check("scatter", group, out, f"src {src}")
    try:
        dist.scatter(out, [c.contiguous() for c in chunks] if me_src else None, src=src, group=group.handle)
    except RuntimeError as exc:
        _fault.fail("scatter", group, exc, peer=None if me_src else src)
    return out


def split_scatter(tensor: torch.Tensor, dim: int, group, src: int, sizes: Sequence[int]) -> torch.Tensor:
    """Cut ``tensor`` (read on global rank ``src`` only) along ``dim`` into ``sizes`` and give piece i to group rank i.

    Every rank passes a tensor of the full shape (the non-source ranks' values are
    ignored); uneven pieces are padded for the wire and trimmed after.
    """
    k = group.size
    if k == 1:
        return tensor
    m = max(sizes)
    me = group.rank
    shape = list(tensor.shape)
    shape[dim] = m
    out = tensor.new_empty(shape)
    if out.numel() == 0:  # nothing to move (known alike on every rank)
        return out.narrow(dim, 0, sizes[me])
    chunks = None
    if dist.get_rank() == src:
        chunks, start = [], 0
        for s in sizes:
            chunks.append(wire.pad_dim(tensor.narrow(dim, start, s), dim, m).contiguous())
            start += s
    scatter(out, chunks, group, src)
    return out if sizes[me] == m else out.narrow(dim, 0, sizes[me]).contiguous()


def gather(tensor: torch.Tensor, dim: int, group, dst: int, sizes: Sequence[int]):
    """Concatenate every rank's ``tensor`` along ``dim`` on global rank ``dst`` (``None`` elsewhere).

    ``sizes[i]`` is group rank i's extent along ``dim``; pieces are padded for the wire.
    """
    k = group.size
    if k == 1:
        return tensor
    m = max(sizes)
    xt = wire.pad_dim(tensor, dim, m).contiguous()
    me_dst = dist.get_rank() == dst
    if xt.numel() == 0:
        shape = list(tensor.shape)
        shape[dim] = sum(sizes)
        return tensor.new_empty(shape) if me_dst else None
    bufs = [torch.empty_like(xt) for _ in range(k)] if me_dst else None
    rec.record(rec.GATHER, _nbytes(xt), group.ranks, is_src=me_dst)
    if _CHECK[0]:
        _fault.check("gather", group, xt, f"dim {dim}, sizes {list(sizes)}, dst {dst}")
    try:
        dist.gather(xt, bufs, dst=dst, group=group.handle)
    except RuntimeError as exc:
        _fault.fail("gather", group, exc, peer=None if me_dst else dst)
    if not me_dst:
        return None
    return torch.cat([b if s == m else b.narrow(dim, 0, s) for b, s in zip(bufs, sizes)], dim=dim)


def reduce(tensor: torch.Tensor, group, dst: int, reduction: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` onto global rank ``dst``.

    Returns the reduction on ``dst``; on the other ranks the returned buffer's
    contents are unspecified (``tensor`` itself is never modified).
    """
    k = group.size
    if k == 1:
        return tensor
    tensor, reduction, back = wire.logical(tensor, reduction)
    if back is not None:
        return reduce(tensor, group, dst, reduction).to(back)
    out = tensor.contiguous().clone()
    me_dst = dist.get_rank() == dst
    rec.record(rec.REDUCE, _nbytes(out), group.ranks, is_src=me_dst)
    if reduction == "avg" and not out.is_floating_point():
        raise TypeError(f"reduce(op='avg') needs a floating dtype, got {out.dtype}")
    if _CHECK[0]:
        _fault.check("reduce", group, out, f"dst {dst}, op {reduction}")
    try:
        dist.reduce(out, dst=dst, op=reduce_op("sum" if reduction == "avg" else reduction), group=group.handle)
    except RuntimeError as exc:
        _fault.fail("reduce", group, exc, peer=None if me_dst else dst)
    if reduction == "avg":
        return out / k if me_dst else out
    return out


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking)."""
    rec.record(rec.SEND, _nbytes(tensor), (dist.get_rank(), dst))
    try:
        dist.send(tensor.contiguous(), dst=dst, group=group.handle if group is not None else None)
    except RuntimeError as exc:
        _fault.fail("send", group, exc, peer=dst)


def recv(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Receive into ``tensor`` from global rank ``src`` (blocking); returns ``tensor``."""
    rec.record(rec.RECV, _nbytes(tensor), (src, dist.get_rank()))
    try:
        dist.recv(tensor, src=src, group=group.handle if group is not None else None)
    except RuntimeError as exc:
        _fault.fail("recv", group, exc, peer=src)
    return tensor
