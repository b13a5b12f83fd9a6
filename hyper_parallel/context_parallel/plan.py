"""Sequence layouts of context parallelism: which global positions each cp rank holds (pure arithmetic).

A *layout* is, per cp rank, a list of ``(start, length)`` segments of global positions, in the
order the rank stores them (its local rows are the concatenation). Everything else (shard and
unshard indices, the Ulysses and ring position lists, block skipping) is derived from it.

* ``load_balance=False``: rank ``r`` holds one contiguous segment; lengths differ by at most one
  (``balanced_sizes``), so no rank is empty while ``S >= cp``.
* ``load_balance=True`` (head-tail / zigzag): the sequence is cut into ``2 * cp`` chunks and rank
  ``r`` holds chunks ``r`` and ``2cp-1-r``. When ``S`` is not divisible by ``2 * cp`` the extra
  ``e = S % 2cp`` positions go one per rank, head chunks first (``r < min(e, cp)``), then tail
  chunks (``r < e - cp``): shard lengths differ by at most one and the causal work per rank by at
  most one row and one column; no padding exists anywhere.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

Segment = Tuple[int, int]  # (global start, length)
Layout = List[List[Segment]]


def balanced_sizes(total: int, parts: int) -> List[int]:
    """``total`` split into ``parts`` sizes differing by at most one, larger first."""
    if parts < 1:
        raise ValueError(f"balanced_sizes: parts must be >= 1, got {parts}")
    q, e = divmod(total, parts)
    return [q + (1 if i < e else 0) for i in range(parts)]


def check_seq_len(seq_len: int, cp_size: int, what: str) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 0:
        raise ValueError(f"{what}: sequence length must be a non-negative int, got {seq_len!r}")
    if seq_len < cp_size:
        raise ValueError(f"{what}: sequence length {seq_len} is smaller than the cp degree {cp_size}; every cp rank "
                         f"needs at least one position (expected seq_len >= {cp_size})")


def zigzag_chunk_sizes(seq_len: int, cp_size: int) -> List[int]:
    """Lengths of the ``2 * cp_size`` head-tail chunks (chunk ``c`` covers positions in order)."""
    q, e = divmod(seq_len, 2 * cp_size)
    sizes = [q] * (2 * cp_size)
    for r in range(min(e, cp_size)):
        sizes[r] += 1                   # head chunk of rank r
    for r in range(max(0, e - cp_size)):
        sizes[2 * cp_size - 1 - r] += 1      # tail chunk of rank r
    return sizes


def shard_layout(seq_len: int, cp_size: int, load_balance: bool) -> Layout:
    """Per cp rank, the segments of global positions it holds (in local order)."""
    check_seq_len(seq_len, cp_size, "cp layout")
    if not load_balance:
        out, start = [], 0
        for n in balanced_sizes(seq_len, cp_size):
            out.append([(start, n)])
            start += n
        return out
    sizes = zigzag_chunk_sizes(seq_len, cp_size)
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    out = []
    for r in range(cp_size):
        segs = [(starts[c], sizes[c]) for c in (r, 2 * cp_size - 1 - r) if sizes[c] > 0]
        out.append(segs)
    return out


def chunk_layout(seq_len: int, cp_size: int) -> Layout:
    """The layout of a ``Shard(seq)`` DTensor (``torch.chunk`` rules: ceil-sized, last pieces short/empty)."""
    c = -(-seq_len // cp_size) if cp_size else 0
    out = []
    for r in range(cp_size):
        s = min(r * c, seq_len)
        out.append([(s, max(0, min(c, seq_len - s)))])
    return out


def nested_chunk_layout(seq_len: int, sizes: Sequence[int]) -> Layout:
    """The layout of a DTensor sharded on the sequence by several mesh dims (outer first): each mesh dim
    chunks the piece the previous ones left (``torch.chunk`` rules); flat rank = row-major index."""
    pieces = [(0, seq_len)]
    for k in sizes:
        nxt = []
        for start, n in pieces:
            for (s, m), in chunk_layout(n, k):
                nxt.append((start + s, m))
        pieces = nxt
    return [[p] for p in pieces]


def seg_len(segs: Sequence[Segment]) -> int:
    return sum(n for _, n in segs)


def positions(segs: Sequence[Segment]) -> List[int]:
    """The global positions of a rank's local rows."""
    out: List[int] = []
    for s, n in segs:
        out.extend(range(s, s + n))
    return out


def concat_layout(layout: Layout, ranks: Sequence[int]) -> List[Segment]:
    """The segments of the ranks ``ranks`` concatenated in that order (what an all_to_all joins)."""
    return [seg for r in ranks for seg in layout[r]]


def shard_index(layout: Layout, rank: int) -> List[int]:
    """Global positions to take (``index_select``) for ``rank``'s shard."""
    return positions(layout[rank])


def restore_index(layout: Layout) -> List[int]:
    """For the concatenation of every rank's shard in rank order, the row of each global position."""
    order = positions([seg for segs in layout for seg in segs])
    inv = [0] * len(order)
    for row, pos in enumerate(order):
        inv[pos] = row
    return inv


def is_identity(idx: Sequence[int]) -> bool:
    return all(i == j for j, i in enumerate(idx))


def head_split(n_heads: int, cp_size: int, what: str) -> List[int]:
    """Heads per rank for Ulysses (uneven when ``cp_size`` does not divide ``n_heads``)."""
    if n_heads < cp_size:
        raise ValueError(f"{what}: Ulysses cannot split {n_heads} query heads over cp degree {cp_size}; every rank "
                         f"needs at least one head (expected n_heads >= {cp_size}; use method='ring' or 'hybrid')")
    return balanced_sizes(n_heads, cp_size)


def kv_head_plan(n_q: int, n_kv: int, cp_size: int, what: str) -> Tuple[int, List[int]]:
    """Ulysses K/V heads: (replication factor applied before the all_to_all, per-rank kv head counts).

    Even query split (``cp_size | n_q``): K/V heads are repeated ``lcm(n_kv, cp_size) / n_kv`` times (1 when
    ``cp_size | n_kv``), so rank r's query heads find their K/V heads locally with the same GQA grouping.
    Uneven query split: K/V are expanded to one head per query head and split like the queries.
    """
    if n_kv < 1 or n_q % n_kv:
        raise ValueError(f"{what}: the number of query heads ({n_q}) must be a multiple of the number of "
                         f"key/value heads ({n_kv})")
    qs = head_split(n_q, cp_size, what)
    if n_q % cp_size == 0:
        import math
        f = (n_kv * cp_size // math.gcd(n_kv, cp_size)) // n_kv
        return f, balanced_sizes(n_kv * f, cp_size)
    return n_q // n_kv, qs


__all__ = ["Segment", "Layout", "balanced_sizes", "check_seq_len", "zigzag_chunk_sizes", "shard_layout",
           "chunk_layout", "nested_chunk_layout", "seg_len", "positions", "concat_layout", "shard_index", "restore_index", "is_identity",
           "head_split", "kv_head_plan"]
