"""How uneven pieces travel on the wire, shared by the eager and the traced collectives.

``collectives`` (eager, in-place ``torch.distributed`` calls) and ``compile_collectives``
(functional collectives while ``torch.compile`` traces) must cut, pad and reassemble
pieces identically, or compiled and eager programs would disagree; the arithmetic lives
here once and each caller only issues its own kind of collective.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


# bool pieces travel as uint8 (NCCL has no bool); in bool arithmetic sum is "or" and prod is "and";
# all/any reduce truth values with min/max
_LOGICAL_OPS = {"sum": "max", "prod": "min", "max": "max", "min": "min", "all": "min", "any": "max"}


def logical(x: torch.Tensor, op: str):
    """(tensor to reduce, op to reduce it with, dtype to return) for reduce op ``op`` on ``x``.

    ``all``/``any`` reduce the truth values of the pieces (``x != 0``) with min/max and
    give 0/1 (``False``/``True``) in ``x``'s dtype; bool pieces travel as uint8 with
    sum -> max (or) and prod -> min (and); every other case is ``x`` and ``op`` unchanged.
    """
    if op in ("all", "any"):
        return (x != 0).to(torch.uint8), _LOGICAL_OPS[op], x.dtype
    if x.dtype == torch.bool:
        if op not in _LOGICAL_OPS:
            raise TypeError(f"reduce_op={op!r} needs a numeric dtype, got torch.bool")
        return x.to(torch.uint8), _LOGICAL_OPS[op], x.dtype
    return x, op, None


def pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` extended with zeros along ``dim`` to ``size`` (itself when already that long)."""
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def reduce_scatter_sizes(x: torch.Tensor, dim: int, k: int, sizes) -> List[int]:
    """Per-rank sizes of ``x`` along ``dim`` for a reduce_scatter over ``k`` ranks (even split by default)."""
    if sizes is not None:
        return list(sizes)
    n = x.shape[dim]
    if n % k:
        raise ValueError(f"reduce_scatter: dim {dim} of size {n} is not divisible by the group size {k}; pass sizes")
    return [n // k] * k


def reduce_scatter_input(x: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """``x`` with ``dim`` moved first and every rank's piece padded to the largest (contiguous)."""
    m = max(sizes)
    xt = x.movedim(dim, 0) if dim != 0 else x
    if any(s != m for s in sizes):
        xt = torch.cat([pad_dim(p, 0, m) for p in torch.split(xt, list(sizes), dim=0)], dim=0)
    return xt.contiguous()


def reduce_scatter_output(out: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """This rank's received (padded, dim-first) piece trimmed to ``size`` and put back at ``dim``."""
    out = out[:size]
    return out.movedim(0, dim).contiguous() if dim != 0 else out


def all_to_all_pack(x: torch.Tensor, split_dim: int, cat_dim: int, split_sizes: Sequence[int],
                    cat_sizes: Sequence[int], me: int) -> Tuple[torch.Tensor, List[int], List[int]]:
    """The flat send buffer and the input/output split sizes of an ``all_to_all_single``.

    ``x`` is cut along ``split_dim`` into ``split_sizes`` (piece i goes to rank i); the piece
    arriving from rank r has ``cat_sizes[r]`` along ``cat_dim`` and ``split_sizes[me]`` along
    ``split_dim``. Uneven sizes travel as uneven splits (no padding).
    """
    pieces = torch.split(x, list(split_sizes), dim=split_dim)
    send = torch.cat([p.contiguous().view(-1) for p in pieces]) if x.numel() else x.new_empty(0)
    in_splits = [p.numel() for p in pieces]
    inner = 1
    for d, s in enumerate(x.shape):
        if d not in (split_dim, cat_dim):
            inner *= s
    out_splits = [c * split_sizes[me] * inner for c in cat_sizes]
    return send, in_splits, out_splits


def all_to_all_unpack(recv: torch.Tensor, x_shape, split_dim: int, cat_dim: int, split_sizes: Sequence[int],
                      cat_sizes: Sequence[int], me: int, out_splits: Sequence[int]) -> torch.Tensor:
    """The received flat buffer of ``all_to_all_pack``'s exchange, joined along ``cat_dim``."""
    shape = list(x_shape)
    shape[split_dim] = split_sizes[me]
    outs = []
    for r, chunk in enumerate(torch.split(recv, list(out_splits))):
        shape[cat_dim] = cat_sizes[r]
        outs.append(chunk.view(shape))
    return torch.cat(outs, dim=cat_dim)
