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


def logical(tensor: torch.Tensor, reduction: str):
    """(tensor to reduce, op to reduce it with, dtype to return) for reduce op ``reduction`` on ``tensor``.

    ``all``/``any`` reduce the truth values of the pieces (``tensor != 0``) with min/max and
    give 0/1 (``False``/``True``) in ``tensor``'s dtype; bool pieces travel as uint8 with
    sum -> max (or) and prod -> min (and); every other case is ``tensor`` and ``reduction`` unchanged.
    """
    if reduction in ("all", "any"):
        return (tensor != 0).to(torch.uint8), _LOGICAL_OPS[reduction], tensor.dtype
    if tensor.dtype == torch.bool:
        if reduction not in _LOGICAL_OPS:
            raise TypeError(f"reduce_op={reduction!r} needs a numeric dtype, got torch.bool")
        return tensor.to(torch.uint8), _LOGICAL_OPS[reduction], tensor.dtype
    return tensor, reduction, None


def pad_dim(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` extended with zeros along ``dim`` to ``size`` (itself when already that long)."""
    if tensor.shape[dim] == size:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = size - tensor.shape[dim]
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def reduce_scatter_sizes(tensor: torch.Tensor, dim: int, ranks: int, sizes) -> List[int]:
    """Per-rank sizes of ``tensor`` along ``dim`` for a reduce_scatter over ``ranks`` ranks (even split by default)."""
    if sizes is not None:
        return list(sizes)
    n = tensor.shape[dim]
    if n % ranks:
        raise ValueError(f"reduce_scatter: dim {dim} of size {n} is not divisible by the group size {ranks}; pass sizes")
    return [n // ranks] * ranks


def reduce_scatter_input(tensor: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """``tensor`` with ``dim`` moved first and every rank's piece padded to the largest (contiguous)."""
    m = max(sizes)
    xt = tensor.movedim(dim, 0) if dim != 0 else tensor
    if any(s != m for s in sizes):
        xt = torch.cat([pad_dim(p, 0, m) for p in torch.split(xt, list(sizes), dim=0)], dim=0)
    return xt.contiguous()


def reduce_scatter_output(out: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """This rank's received (padded, dim-first) piece trimmed to ``size`` and put back at ``dim``."""
    out = out[:size]
    return out.movedim(0, dim).contiguous() if dim != 0 else out


def all_to_all_pack(tensor: torch.Tensor, split_dim: int, cat_dim: int, split_sizes: Sequence[int],
                    cat_sizes: Sequence[int], my_index: int) -> Tuple[torch.Tensor, List[int], List[int]]:
    """The flat send buffer and the input/output split sizes of an ``all_to_all_single``.

    ``tensor`` is cut along ``split_dim`` into ``split_sizes`` (piece i goes to rank i); the piece
    arriving from rank r has ``cat_sizes[r]`` along ``cat_dim`` and ``split_sizes[my_index]`` along
    ``split_dim``. Uneven sizes travel as uneven splits (no padding).
    """
    pieces = torch.split(tensor, list(split_sizes), dim=split_dim)
    send = torch.cat([p.contiguous().view(-1) for p in pieces]) if tensor.numel() else tensor.new_empty(0)
    in_splits = [p.numel() for p in pieces]
    inner = 1
    for d, s in enumerate(tensor.shape):
        if d not in (split_dim, cat_dim):
            inner *= s
    out_splits = [c * split_sizes[my_index] * inner for c in cat_sizes]
    return send, in_splits, out_splits


def all_to_all_unpack(recv: torch.Tensor, x_shape, split_dim: int, cat_dim: int, split_sizes: Sequence[int],
                      cat_sizes: Sequence[int], my_index: int, out_splits: Sequence[int]) -> torch.Tensor:
    """The received flat buffer of ``all_to_all_pack``'s exchange, joined along ``cat_dim``."""
    shape = list(x_shape)
    shape[split_dim] = split_sizes[my_index]
    outs = []
    for r, chunk in enumerate(torch.split(recv, list(out_splits))):
        shape[cat_dim] = cat_sizes[r]
        outs.append(chunk.view(shape))
    return torch.cat(outs, dim=cat_dim)
