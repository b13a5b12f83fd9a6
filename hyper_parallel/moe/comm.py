"""The collectives of expert parallelism: a variable-split all_to_all (differentiable) and the count exchange.

Each collective is reported to :mod:`hyper_parallel.distributed.comm_record` (``CommDebugMode``
counts them) with the bytes this rank sends to the other ranks. Host synchronisations
(device -> host reads of counts) are counted in :data:`STATS` so benchmarks and tests can
check that dispatch syncs once per call (the count exchange) and nowhere else.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from hyper_parallel.distributed import comm_record as rec

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: counters: ``host_syncs`` (device->host reads of counts), ``dispatches`` (count exchanges)
STATS = {"host_syncs": 0, "count_exchanges": 0}


def reset_stats() -> None:
    for k in STATS:
        STATS[k] = 0


def to_host(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``, counted as one host synchronisation."""
    STATS["host_syncs"] += 1
    return tensor.tolist()


def _row_bytes(tensor: torch.Tensor) -> int:
    n = 1
    for s in tensor.shape[1:]:
        n *= s
    return n * tensor.element_size()


def all_to_all_v(tensor: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int], group) -> torch.Tensor:
    """Rows ``tensor[sum(in_splits[:r]) : ... + in_splits[r]]`` go to group rank ``r``; the received blocks are
    concatenated in source-rank order (``out_splits[r]`` rows from rank ``r``). One ``all_to_all_single``."""
    if group.size == 1:
        return tensor
    tensor = tensor.contiguous()
    out = tensor.new_empty((sum(out_splits),) + tuple(tensor.shape[1:]))
    rb = _row_bytes(tensor)
    me = group.rank
    rec.record(rec.ALL_TO_ALL, tensor.numel() * tensor.element_size(), group.ranks,
               sent=(sum(in_splits) - in_splits[me]) * rb)
    dist.all_to_all_single(out, tensor, list(out_splits), list(in_splits), group=group.handle)
    return out


class AllToAllV(torch.autograd.Function):
    """Differentiable :func:`all_to_all_v`; the backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, tensor, in_splits, out_splits, group):
        ctx.args = (in_splits, out_splits, group)
        return all_to_all_v(tensor, in_splits, out_splits, group)

    @staticmethod
    def backward(ctx, grad_output):
        in_splits, out_splits, group = ctx.args
        return all_to_all_v(grad_output, out_splits, in_splits, group), None, None, None


def exchange(tensor: torch.Tensor, in_splits, out_splits, group) -> torch.Tensor:
    if group.size == 1:
        return tensor
    return AllToAllV.apply(tensor, tuple(in_splits), tuple(out_splits), group)


def count_all_to_all(msg: torch.Tensor, group) -> torch.Tensor:
    """The count exchange: ``msg`` is ``[ep, m]`` (row ``r`` for rank ``r``); returns ``[ep, m]`` (row ``r``
    from rank ``r``). Integer tensor, no gradient."""
    STATS["count_exchanges"] += 1
    if group.size == 1:
        return msg
    msg = msg.contiguous()
    out = torch.empty_like(msg)
    rec.record(rec.ALL_TO_ALL, msg.numel() * msg.element_size(), group.ranks)
    dist.all_to_all_single(out, msg, group=group.handle)
    return out


def count_all_gather(msg: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``msg`` (``[m]``) stacked to ``[ep, m]`` (the count exchange of capacity mode)."""
    STATS["count_exchanges"] += 1
    if group.size == 1:
        return msg.unsqueeze(0)
    msg = msg.contiguous()
    out = msg.new_empty((group.size * msg.shape[0],) + tuple(msg.shape[1:]))
    rec.record(rec.ALL_GATHER, msg.numel() * msg.element_size(), group.ranks)
    _all_gather_single(out, msg, group=group.handle)
    return out.view((group.size,) + tuple(msg.shape))


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is None or group.size == 1:
        return tensor
    out = tensor.contiguous().clone()
    rec.record(rec.ALL_REDUCE, out.numel() * out.element_size(), group.ranks)
    dist.all_reduce(out, group=group.handle)
    return out
