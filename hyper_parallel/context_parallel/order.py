"""The sequence order of context-parallel shards: an explicit property from the shard helper to attention.

Attention over sequence shards is only correct if it knows which global position every local row
holds. Each shard helper records that here for its cp group (the global ranks of the 1-D cp mesh):

* :func:`~.shard.cp_shard`: hyper_parallel's own layouts (contiguous, or head-tail);
* ``_context_parallel_shard`` (torch 2.13's private helper, :mod:`.torch_private`): the load
  balancer's reorder indices (head-tail, per-document head-tail, PTRR, none, or any user
  balancer's permutation), then ``torch.chunk`` of the reordered sequence over the cp ranks.

A :class:`SequenceOrder` is the reorder indices (one row shared by the batch, or one per batch row)
and the cp degree; its :meth:`layouts` are the segments of global positions per rank that the ring
attention plans on. Attention reads the recorded order and checks it against its inputs' local
lengths; where no order is recorded or it does not fit, it raises (never a silent guess).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from hyper_parallel.context_parallel.plan import Layout, chunk_layout, positions, seg_len


def _runs(pos: Sequence[int]) -> List[Tuple[int, int]]:
    """Consecutive runs of ``pos`` as ``(start, length)`` segments, in order."""
    out: List[Tuple[int, int]] = []
    for p in pos:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


class SequenceOrder:
    """Rank ``r``'s local rows are global positions ``perm[b][chunk_r]`` (``torch.chunk`` of the reordered
    sequence over ``cp`` ranks). ``perm`` has one row (every batch row alike) or one per batch row."""

    __slots__ = ("perm", "cp", "source", "_layouts")

    def __init__(self, perm: Sequence[Sequence[int]], cp_size: int, source: str = "", what: str = "SequenceOrder"):
        rows = tuple(tuple(int(i) for i in row) for row in perm)
        if not rows:
            raise ValueError(f"{what}: the reorder indices are empty (expected shape (1, seq_len) or (B, seq_len))")
        S = len(rows[0])
        for b, row in enumerate(rows):
            if len(row) != S or sorted(row) != list(range(S)):
                raise ValueError(f"{what}: reorder indices row {b} is not a permutation of range({S}) (got "
                                 f"{list(row[:16])}{'...' if len(row) > 16 else ''}); a load balancer must "
                                 "return a permutation of the sequence positions")
        if not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"{what}: cp degree must be an int >= 1, got {cp_size!r}")
        if S < cp_size:
            raise ValueError(f"{what}: sequence length {S} is smaller than the cp degree {cp_size}")
        self.perm, self.cp, self.source = rows, cp_size, source
        self._layouts = None

    @classmethod
    def from_layout(cls, layout: Layout, source: str = "") -> "SequenceOrder":
        """The order of a hyper_parallel layout (``plan.shard_layout``): ranks' positions concatenated."""
        order = cls([positions([s for segs in layout for s in segs])], len(layout), source)
        got = order.layouts()[0]
        if [seg_len(a) for a in got] != [seg_len(b) for b in layout]:
            # not torch.chunk's split (uneven head-tail): keep the layout itself
            order._layouts = [[list(segs) for segs in layout]]
        return order

    @classmethod
    def natural(cls, seq_len: int, cp_size: int, source: str = "") -> "SequenceOrder":
        return cls([list(range(seq_len))], cp_size, source)

    @property
    def seq_len(self) -> int:
        return len(self.perm[0])

    @property
    def batch(self) -> int:
        return len(self.perm)

    def layouts(self) -> List[Layout]:
        """Per batch row of ``perm``, per rank, the segments of global positions it holds (in local order)."""
        if self._layouts is None:
            chunks = chunk_layout(self.seq_len, self.cp)
            self._layouts = [[_runs(row[s:s + n]) for ((s, n),) in chunks] for row in self.perm]
        return self._layouts

    def local_len(self, rank: int) -> int:
        return seg_len(self.layouts()[0][rank])

    def is_natural(self) -> bool:
        return all(row == tuple(range(self.seq_len)) for row in self.perm)

    def __eq__(self, other):
        return (isinstance(other, SequenceOrder) and self.cp == other.cp
                and [[list(map(tuple, s)) for s in lay] for lay in self.layouts()]
                == [[list(map(tuple, s)) for s in lay] for lay in other.layouts()])

    def __hash__(self):
        return hash((self.perm, self.cp))

    def __repr__(self):
        head = list(self.perm[0][:8])
        return (f"SequenceOrder(seq_len={self.seq_len}, cp={self.cp}, batch_rows={self.batch}, "
                f"first={head}{'...' if self.seq_len > 8 else ''}{', from ' + self.source if self.source else ''})")


# cp group (global ranks of the 1-D cp mesh, in mesh order) -> the order of the last sharding on it
_ORDERS: Dict[Tuple[int, ...], SequenceOrder] = {}


def group_key(mesh) -> Tuple[int, ...]:
    """The registry key of a cp mesh (hyper_parallel's or torch's): its global ranks in row-major order."""
    return tuple(int(r) for r in mesh.rank_list) if hasattr(mesh, "rank_list") else \
        tuple(int(r) for r in mesh.mesh.flatten().tolist())


def record(key: Tuple[int, ...], order: SequenceOrder) -> None:
    if len(key) != order.cp:
        raise ValueError(f"sequence order for cp group {key}: the order has cp degree {order.cp}")
    _ORDERS[tuple(key)] = order


def recorded(key: Tuple[int, ...]) -> Optional[SequenceOrder]:
    return _ORDERS.get(tuple(key))


def forget(key: Tuple[int, ...] = None) -> None:
    """Drop the recorded order of one cp group (all with no argument)."""
    if key is None:
        _ORDERS.clear()
    else:
        _ORDERS.pop(tuple(key), None)


__all__ = ["SequenceOrder", "group_key", "record", "recorded", "forget"]
