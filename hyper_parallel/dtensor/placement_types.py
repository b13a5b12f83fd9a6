"""Placements: how a tensor sits on one mesh dimension.

Small immutable value types, equal and hashable by value, mirroring
``torch.distributed.tensor.placement_types``:

* ``Shard(dim)``: the tensor is split along ``dim`` (``torch.chunk`` rules).
* ``Replicate()``: every rank holds the whole tensor.
* ``Partial(reduce_op)``: every rank holds a partial value; the tensor is the
  reduction (``sum``, ``avg``, ``max``, ``min``, ``prod``, or the logical
  ``all`` / ``any`` of the pieces' truth values) over the ranks.
* ``_StridedShard(dim, split_factor=k)``: PyTorch's private placement for a dim that
  was sharded "right to left" (FSDP's shard inside a TP or EP shard): the current
  piece is cut into ``k`` groups, each group into one chunk per rank, and a rank
  holds its chunk of every group. ``is_shard()`` is False for it, as in PyTorch.

Pure Python: the module imports no framework (the ``pure-math`` import contract), so the
layout math built on it stays torch-free. PyTorch's tensor helpers (``_split_tensor``)
work through the methods of the tensor they are handed.
"""
from __future__ import annotations
from enum import IntEnum
from typing import Any, List, Optional, Sequence, Tuple, Union

_REDUCE_OPS = ("sum", "avg", "max", "min", "prod", "all", "any")


class Placement:
    """Base class; use :class:`Shard`, :class:`Replicate` or :class:`Partial`."""

    __slots__ = ()

    def is_shard(self, dim: Optional[int] = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class Shard(Placement):
    __slots__ = ("dim",)
    dim: int

    @staticmethod
    def local_shard_size_and_offset(curr_local_size: int, num_chunks: int, rank: int) -> Tuple[int, int]:
        """``(size, offset)`` of chunk ``rank`` of ``curr_local_size`` cut into ``num_chunks`` (torch.chunk rules).

        PyTorch 2.13's static method: the offset is relative to the current piece; an
        empty trailing chunk gets offset ``curr_local_size``.
        """
        full = -(-curr_local_size // num_chunks)
        start = full * rank
        end = min(curr_local_size, start + full)
        return max(0, end - start), min(curr_local_size, start)

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int) -> Tuple[int, int]:
        return Shard.local_shard_size_and_offset(curr_local_size, num_chunks, rank)

    def __init__(self, dim: int):
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"Shard(dim): dim must be an int, got {dim!r} ({type(dim).__name__})")
        object.__setattr__(self, "dim", dim)

    def is_shard(self, dim: Optional[int] = None) -> bool:
        return dim is None or dim == self.dim

    def __eq__(self, other):
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self):
        return hash(("S", self.dim))

    def __repr__(self):
        return f"Shard(dim={self.dim})"

    def __str__(self):
        return f"S({self.dim})"

    def __reduce__(self):
        return (Shard, (self.dim,))

    def _split_tensor(self, tensor, num_chunks: int, *, with_padding: bool = True, contiguous: bool = True):
        """``(pieces, pad_sizes)``: ``tensor`` split into ``num_chunks`` pieces along ``self.dim`` (PyTorch's helper).

        ``torch.chunk`` sizes, with empty pieces at the end when there are fewer
        chunks than ranks; with ``with_padding`` every piece is zero-padded to the
        first one's size and ``pad_sizes`` says by how much (else it is empty).
        """
        if not isinstance(num_chunks, int) or num_chunks <= 0:
            raise ValueError(f"Shard._split_tensor: num_chunks must be a positive int, got {num_chunks!r}")
        dim = self.dim + tensor.dim() if self.dim < 0 else self.dim
        if not 0 <= dim < tensor.dim():
            raise ValueError(f"Shard._split_tensor: Shard({self.dim}) is out of range for a {tensor.dim()}-d tensor")
        pieces = list(tensor.chunk(num_chunks, dim))
        while len(pieces) < num_chunks:
            pieces.append(tensor.narrow(dim, tensor.shape[dim], 0))
        full = -(-tensor.shape[dim] // num_chunks)
        pads = []
        if with_padding:
            for i, p in enumerate(pieces):
                pad = full - p.shape[dim]
                pads.append(pad)
                if pad:
                    shape = list(p.shape)
                    shape[dim] = pad
                    pieces[i] = _concat([p, p.new_zeros(shape)], dim)
        if contiguous:
            pieces = [p.contiguous() for p in pieces]
        return pieces, pads


class Replicate(Placement):
    __slots__ = ()

    def is_replicate(self) -> bool:
        return True

    def __eq__(self, other):
        return type(other) is Replicate

    def __hash__(self):
        return hash("R")

    def __repr__(self):
        return "Replicate()"

    def __str__(self):
        return "R"

    def __reduce__(self):
        return (Replicate, ())


class Partial(Placement):
    __slots__ = ("reduce_op",)
    reduce_op: str

    def __init__(self, reduce_op: str = "sum"):
        if reduce_op not in _REDUCE_OPS:
            raise ValueError(f"Partial(reduce_op): got {reduce_op!r}, expected one of {_REDUCE_OPS}")
        object.__setattr__(self, "reduce_op", reduce_op)

    def is_partial(self) -> bool:
        return True

    def __eq__(self, other):
        return type(other) is Partial and other.reduce_op == self.reduce_op

    def __hash__(self):
        return hash(("P", self.reduce_op))

    def __repr__(self):
        return f"Partial({self.reduce_op})"

    def __str__(self):
        return f"P({self.reduce_op})"  # as PyTorch

    def __reduce__(self):
        return (Partial, (self.reduce_op,))


class _StridedShardOffsetMode(IntEnum):
    """What ``_StridedShard.local_shard_size_and_offset`` returns as offset (PyTorch's enum)."""
    FIRST = 0
    ALL = 1
    NONE = 2


class _StridedShard(Placement):
    """PyTorch's ``_StridedShard(dim, split_factor=k)``: right-to-left sharding written left to right.

    On mesh dim ``m`` of size ``n`` the current piece of tensor dim ``dim`` is cut into
    ``k`` groups (``torch.chunk`` rules), each group into ``n`` chunks, and the rank at
    coordinate ``r`` holds chunk ``r`` of every group, concatenated. FSDP over a TP
    shard of the same dim gives ``(_StridedShard(d, split_factor=tp), Shard(d))``
    on a ``(dp, tp)`` mesh: the TP shard is the outer one. ``is_shard()`` is False
    (PyTorch's ``_is_shard_like`` covers both); it is not equal to ``Shard(dim)``.
    """

    __slots__ = ("dim", "split_factor")
    dim: int
    split_factor: int

    def __init__(self, dim: int, *, split_factor: int = 1, sf: Optional[int] = None):
        if sf is not None:
            if split_factor != 1:
                raise TypeError("_StridedShard received both split_factor and sf")
            split_factor = sf
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"_StridedShard(dim): dim must be an int, got {dim!r} ({type(dim).__name__})")
        if isinstance(split_factor, bool) or not isinstance(split_factor, int):
            try:
                split_factor = int(split_factor)
            except (TypeError, ValueError):
                raise TypeError(f"_StridedShard(split_factor): expected a positive int, got {split_factor!r}") from None
        if split_factor < 1:
            raise ValueError(f"_StridedShard(split_factor): expected a positive int, got {split_factor}")
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "split_factor", split_factor)

    def _split_factor_int(self) -> int:
        return self.split_factor

    def __eq__(self, other):
        return type(other) is _StridedShard and other.dim == self.dim and other.split_factor == self.split_factor

    def __hash__(self):
        return hash((self.dim, self.split_factor))

    def __repr__(self):
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"

    def __str__(self):
        return f"_S({self.dim}, {self.split_factor})"

    def __reduce__(self):
        return (_rebuild_strided, (self.dim, self.split_factor))

    def strided_indices(self, size: int, num_chunks: int) -> List[List[int]]:
        """Per chunk, the indices (into a piece of extent ``size``) it holds, in order."""
        groups = _chunk_ranges(0, size, self.split_factor)
        out: List[List[int]] = [[] for _ in range(num_chunks)]
        for lo, hi in groups:
            for r, (a, b) in enumerate(_chunk_ranges(lo, hi, num_chunks)):
                out[r].extend(range(a, b))
        return out

    def _split_tensor(self, tensor, num_chunks: int, *, with_padding: bool = True, contiguous: bool = True):
        """``(pieces, pad_sizes)`` as PyTorch: chunk ``r`` of every one of the ``split_factor`` groups, concatenated."""
        if not isinstance(num_chunks, int) or num_chunks <= 0:
            raise ValueError(f"_StridedShard._split_tensor: num_chunks must be a positive int, got {num_chunks!r}")
        dim = self.dim + tensor.dim() if self.dim < 0 else self.dim
        if not 0 <= dim < tensor.dim():
            raise ValueError(f"_StridedShard._split_tensor: dim {self.dim} is out of range for a "
                             f"{tensor.dim()}-d tensor")
        pieces = []
        for idx in self.strided_indices(tensor.shape[dim], num_chunks):
            ranges = _runs(idx)
            parts = [tensor.narrow(dim, a, b - a) for a, b in ranges]
            piece = _concat(parts, dim) if len(parts) > 1 else (parts[0] if parts else tensor.narrow(dim, 0, 0))
            pieces.append(piece.contiguous() if contiguous else piece)
        pads = []
        if with_padding:
            full = max(p.shape[dim] for p in pieces)
            pads = [full - p.shape[dim] for p in pieces]
        return pieces, pads

    def local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int,
                                    offset_mode: _StridedShardOffsetMode = _StridedShardOffsetMode.FIRST
                                    ) -> Tuple[int, Union[int, List[int], None]]:
        """``(size, offsets)`` of chunk ``rank`` (PyTorch 2.13): FIRST gives the first index (-1 when empty),
        ALL every index, NONE no offset."""
        offset_mode = _StridedShardOffsetMode(offset_mode)
        idx = self.strided_indices(int(curr_local_size), num_chunks)[rank]
        if offset_mode is _StridedShardOffsetMode.NONE:
            return len(idx), None
        if offset_mode is _StridedShardOffsetMode.FIRST:
            return len(idx), (idx[0] if idx else -1)
        return len(idx), list(idx)

    _local_shard_size_and_offset = local_shard_size_and_offset


def _concat(parts: Sequence[Any], dim: int) -> Any:
    """``torch.cat(parts, dim)`` of same-dtype tensors, through tensor methods (differentiable, a new tensor)."""
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    out = parts[0].new_empty(shape)
    start = 0
    for p in parts:
        out.narrow(dim, start, p.shape[dim]).copy_(p)
        start += p.shape[dim]
    return out


def _chunk_ranges(start: int, end: int, num_chunks: int) -> List[Tuple[int, int]]:
    """``[start, end)`` of the ``num_chunks`` torch.chunk pieces of ``range(start, end)`` (empty ones at the end)."""
    size = end - start
    full = -(-size // num_chunks) if size else 0
    out = []
    for r in range(num_chunks):
        a = min(size, full * r)
        out.append((start + a, start + min(size, a + full)))
    return out


def _runs(idx: List[int]) -> List[Tuple[int, int]]:
    """Consecutive runs of sorted-by-position indices as ``[start, end)`` ranges."""
    out: List[Tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _rebuild_strided(dim, split_factor):
    return _StridedShard(dim, split_factor=split_factor)


def _is_shard_like(placement: Placement) -> bool:
    """``Shard`` or ``_StridedShard`` (PyTorch's helper of the same name)."""
    return isinstance(placement, (Shard, _StridedShard))


# PyTorch's older private name for Partial (still importable from its placement_types)
_Partial = Partial

__all__ = ["Placement", "Shard", "Replicate", "Partial"]
