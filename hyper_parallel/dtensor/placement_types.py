"""Placements: how a tensor sits on one mesh dimension.

Small immutable value types, equal and hashable by value, mirroring
``torch.distributed.tensor.placement_types``:

* ``Shard(dim)``: the tensor is split along ``dim`` (``torch.chunk`` rules).
* ``Replicate()``: every rank holds the whole tensor.
* ``Partial(reduce_op)``: every rank holds a partial value; the tensor is the
  reduction (``sum``, ``avg``, ``max``, ``min``, ``prod``, or the logical
  ``all`` / ``any`` of the pieces' truth values) over the ranks.
"""
from __future__ import annotations
import torch

_REDUCE_OPS = ("sum", "avg", "max", "min", "prod", "all", "any")


class Placement:
    """Base class; use :class:`Shard`, :class:`Replicate` or :class:`Partial`."""

    __slots__ = ()

    def is_shard(self, dim: int = None) -> bool:
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

    def __init__(self, dim: int):
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"Shard(dim): dim must be an int, got {dim!r} ({type(dim).__name__})")
        object.__setattr__(self, "dim", dim)

    def is_shard(self, dim: int = None) -> bool:
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
            cat = torch.cat
            for i, p in enumerate(pieces):
                pad = full - p.shape[dim]
                pads.append(pad)
                if pad:
                    shape = list(p.shape)
                    shape[dim] = pad
                    pieces[i] = cat([p, p.new_zeros(shape)], dim)
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


# PyTorch's older private name for Partial (still importable from its placement_types)
_Partial = Partial

__all__ = ["Placement", "Shard", "Replicate", "Partial"]
