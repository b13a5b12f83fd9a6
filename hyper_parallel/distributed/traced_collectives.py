"""Traceable versions of the raw collectives, used while ``torch.compile`` traces.

Inside a compiled region the tensors are fake or functional and the graph must
*contain* the communication: ``torch.distributed`` calls on them would either
fail or run once at trace time. Each function here computes the same result as
its namesake in :mod:`collectives` with ``torch.distributed._functional_collectives``
(out-of-place ops plus ``wait_tensor``), which AOTAutograd records and inductor
schedules. The eager path never comes here: :mod:`collectives` checks
``torch.compiler.is_compiling()`` first, so eager keeps its in-place gloo/NCCL calls.

Uneven pieces are padded for the wire and trimmed after, exactly as in eager.

Why this module sits in the ground floor (``distributed/``) and not in ``compile/``: it is the
traced half of each raw collective - :mod:`collectives` calls it, it shares the wire layout
with the eager half, and it knows nothing about DTensors or dynamo's handling of them. It
adapts torch's functional collectives, as :mod:`collectives` adapts the in-place ones; the
compile *feature* (opaque DTensor nodes, compile mode, eager hooks) is ``compile/support.py``.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed._functional_collectives as funcol

from hyper_parallel.distributed import uneven_padding as wire

_OPS = {"sum": "sum", "avg": "avg", "max": "max", "min": "min", "prod": "product", "all": "min", "any": "max"}


def _op(name: str) -> str:
    try:
        return _OPS[name]
    except KeyError:
        raise ValueError(f"reduce_op={name!r} is not supported; expected one of {sorted(_OPS)}") from None


def all_reduce(tensor: torch.Tensor, group, reduction: str = "sum") -> torch.Tensor:
    tensor, reduction, back = wire.logical(tensor, reduction)
    if reduction == "avg" and not tensor.is_floating_point():
        raise TypeError(f"all_reduce(op='avg') needs a floating dtype, got {tensor.dtype}")
    out = funcol.wait_tensor(funcol.all_reduce(tensor.contiguous(), _op(reduction), group.handle))
    return out if back is None else out.to(back)


def all_gather(tensor: torch.Tensor, dim: int, group, sizes: Sequence[int] = None) -> torch.Tensor:
    k = group.size
    if sizes is None:
        sizes = [tensor.shape[dim]] * k
    m = max(sizes)
    xt = wire.pad_dim(tensor, dim, m)
    if dim != 0:
        xt = xt.movedim(dim, 0)
    buf = funcol.wait_tensor(funcol.all_gather_tensor(xt.contiguous(), 0, group.handle))
    if dim == 0 and all(s == m for s in sizes):
        return buf
    pieces = [p if s == m else p.narrow(0, 0, s) for p, s in zip(buf.chunk(k, 0), sizes)]
    return torch.cat([p if dim == 0 else p.movedim(0, dim) for p in pieces], dim=dim)


def reduce_scatter(tensor: torch.Tensor, dim: int, group, sizes: Sequence[int] = None,
                   reduction: str = "sum") -> torch.Tensor:
    tensor, reduction, back = wire.logical(tensor, reduction)
    sizes = wire.reduce_scatter_sizes(tensor, dim, group.size, sizes)
    inp = wire.reduce_scatter_input(tensor, dim, sizes)
    out = funcol.wait_tensor(funcol.reduce_scatter_tensor(inp, _op(reduction), 0, group.handle))
    out = wire.reduce_scatter_output(out, dim, sizes[group.rank])
    return out if back is None else out.to(back)


def all_to_all(tensor: torch.Tensor, split_dim: int, cat_dim: int, group,
               split_sizes: Sequence[int], cat_sizes: Sequence[int]) -> torch.Tensor:
    me = group.rank
    send, in_splits, out_splits = wire.all_to_all_pack(tensor, split_dim, cat_dim, split_sizes, cat_sizes, me)
    recv = funcol.wait_tensor(funcol.all_to_all_single(send, out_splits, in_splits, group.handle))
    return wire.all_to_all_unpack(recv, tensor.shape, split_dim, cat_dim, split_sizes, cat_sizes, me, out_splits)
