"""Attention masks of context parallelism and the block schedule: what to compute, what to skip.

A mask is a rule on global positions ``(q, k)`` (query row, key column):

==========================  =====================================================
``NoMask()``                every pair attends
``CausalMask()``            ``k <= q``
``SlidingWindowMask(w)``    ``q - w < k <= q`` (causal, ``w`` keys including itself)
``DocumentMask(cu_seqlens,  ``doc(q) == doc(k)`` (and ``k <= q`` when causal): packed
causal=True)``              sequences; ``cu_seqlens`` = document boundaries ``[0, ..., S]``
==========================  =====================================================

:func:`classify` decides, for a block of query positions ``[qs, qe)`` against key positions
``[ks, ke)``, whether it is ``EMPTY`` (skipped, never computed), ``FULL`` (computed without a
mask) or ``PARTIAL`` (computed with the dense mask of its positions). :func:`step_calls` groups a
ring step's sub-blocks into as few local kernel calls as possible.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from hyper_parallel.context_parallel.plan import Segment

EMPTY, FULL, PARTIAL = 0, 1, 2


class Mask:
    """Base class of the masks context-parallel attention honours."""

    kind = "?"
    causal = False

    def classify(self, q_start: int, q_end: int, k_start: int, k_end: int) -> int:
        raise NotImplementedError

    def spec(self):
        """Plain data the attention kernels (kernels.py) build dense masks from."""
        return (self.kind,)


@dataclass(frozen=True)
class NoMask(Mask):
    kind = "none"

    def classify(self, q_start, q_end, k_start, k_end):
        return FULL if q_end > q_start and k_end > k_start else EMPTY


@dataclass(frozen=True)
class CausalMask(Mask):
    kind = "causal"
    causal = True

    def classify(self, q_start, q_end, k_start, k_end):
        if q_end <= q_start or k_end <= k_start or k_start > q_end - 1:
            return EMPTY
        return FULL if k_end - 1 <= q_start else PARTIAL


@dataclass(frozen=True)
class SlidingWindowMask(Mask):
    """Causal attention to the ``window`` most recent positions (itself included)."""

    window: int
    kind = "sliding_window"
    causal = True

    def __post_init__(self):
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(f"SlidingWindowMask: window must be an int >= 1, got {self.window!r}")

    def classify(self, q_start, q_end, k_start, k_end):
        w = self.window
        if q_end <= q_start or k_end <= k_start or k_start > q_end - 1 or k_end - 1 <= q_start - w:
            return EMPTY
        return FULL if k_end - 1 <= q_start and k_start > q_end - 1 - w else PARTIAL

    def spec(self):
        return (self.kind, self.window)


@dataclass(frozen=True)
class DocumentMask(Mask):
    """Block-diagonal (causal by default) attention over packed documents.

    ``cu_seqlens``: increasing document boundaries starting at 0 (the last one is the sequence
    length), as in flash-attention's varlen API. Use :meth:`from_doc_ids` for per-position ids.
    """

    cu_seqlens: Tuple[int, ...]
    causal: bool = True
    kind = "document"

    def __post_init__(self):
        cu = tuple(int(c) for c in self.cu_seqlens)
        if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"DocumentMask: cu_seqlens must be strictly increasing and start at 0, got {cu}")
        object.__setattr__(self, "cu_seqlens", cu)

    @staticmethod
    def from_doc_ids(doc_ids: Sequence[int], causal: bool = True) -> "DocumentMask":
        ids = [int(d) for d in doc_ids]
        cu = [0]
        for i in range(1, len(ids)):
            if ids[i] != ids[i - 1]:
                if ids[i] < ids[i - 1]:
                    raise ValueError(f"DocumentMask.from_doc_ids: document ids must be non-decreasing (packed "
                                     f"documents are contiguous), got id {ids[i]} after {ids[i - 1]} at "
                                     f"position {i}")
                cu.append(i)
        cu.append(len(ids))
        return DocumentMask(tuple(cu), causal)

    @property
    def seq_len(self) -> int:
        return self.cu_seqlens[-1]

    def doc(self, pos: int) -> int:
        return bisect.bisect_right(self.cu_seqlens, pos) - 1

    def classify(self, q_start, q_end, k_start, k_end):
        if q_end <= q_start or k_end <= k_start or (self.causal and k_start > q_end - 1):
            return EMPTY
        dq0, dq1, dk0, dk1 = self.doc(q_start), self.doc(q_end - 1), self.doc(k_start), self.doc(k_end - 1)
        if dq1 < dk0 or dk1 < dq0:
            return EMPTY
        if dq0 == dq1 == dk0 == dk1:
            return FULL if not self.causal or k_end - 1 <= q_start else PARTIAL
        return PARTIAL

    def spec(self):
        return (self.kind, self.cu_seqlens, self.causal)


def as_mask(mask, what: str = "context-parallel attention") -> Mask:
    """``"causal"`` / ``"none"`` / ``None`` / a :class:`Mask` -> a :class:`Mask`; anything else raises."""
    if mask is None or mask == "none":
        return NoMask()
    if isinstance(mask, str) and mask == "causal":
        return CausalMask()
    if isinstance(mask, Mask):
        return mask
    raise NotImplementedError(
        f"{what}: mask {mask!r} ({type(mask).__name__}) cannot be honoured; expected 'causal', 'none', None, "
        "CausalMask(), NoMask(), SlidingWindowMask(w) or DocumentMask(cu_seqlens); dense attn_mask tensors "
        "are not supported under context parallelism (they are never silently dropped)")


@dataclass(frozen=True)
class Call:
    """One local kernel call: query rows x key rows (local row ranges), with or without a dense mask."""

    q_rows: Tuple[Tuple[int, int], ...]   # local (lo, hi) ranges of this rank's query rows
    q_pos: Tuple[Segment, ...]            # their global positions (parallel to q_rows)
    k_rows: Tuple[Tuple[int, int], ...]   # local (lo, hi) ranges of the K/V block's rows
    k_pos: Tuple[Segment, ...]
    masked: bool

    @property
    def work(self) -> int:
        """Score entries computed (query rows x key rows)."""
        return sum(h - l for l, h in self.q_rows) * sum(h - l for l, h in self.k_rows)


def _rows(segs: Sequence[Segment]) -> List[Tuple[int, int]]:
    out, at = [], 0
    for _, n in segs:
        out.append((at, at + n))
        at += n
    return out


def _merge(rows, pos):
    """Join adjacent local ranges (and their positions) so a call narrows instead of concatenating."""
    r_out, p_out = [], []
    for (lo, hi), (s, n) in zip(rows, pos):
        if r_out and r_out[-1][1] == lo:
            r_out[-1] = (r_out[-1][0], hi)
            p_out.append((s, n))
        else:
            r_out.append((lo, hi))
            p_out.append((s, n))
    return tuple(r_out), tuple(p_out)


def step_calls(q_segs: Sequence[Segment], k_segs: Sequence[Segment], mask: Mask) -> List[Call]:
    """The kernel calls of one (query block, K/V block) pair; fully masked sub-blocks are skipped.

    Unmasked sub-blocks: query segments that see the same K/V segments share one call (the
    head-tail layout's half blocks). Partially masked sub-blocks: one call per query segment with
    a dense mask over those K/V segments (for a causal mask these are the diagonal blocks, which a
    fused kernel runs with ``is_causal``).
    """
    qr, kr = _rows(q_segs), _rows(k_segs)
    groups: dict = {}
    order = []
    for qi, (qs, qn) in enumerate(q_segs):
        kinds = [(ki, mask.classify(qs, qs + qn, ks, ks + kn)) for ki, (ks, kn) in enumerate(k_segs)]
        full = tuple(ki for ki, kd in kinds if kd == FULL)
        part = tuple(ki for ki, kd in kinds if kd == PARTIAL)
        for kis, masked in ((full, False), (part, True)):
            if not kis:
                continue
            key = (kis, masked, qi if masked else -1)
            if key not in groups:
                groups[key] = []
                order.append(key)
            groups[key].append(qi)
    calls = []
    for key in order:
        kis, masked, _ = key
        qis = groups[key]
        q_rows, q_pos = _merge([qr[i] for i in qis], [tuple(q_segs[i]) for i in qis])
        k_rows, k_pos = _merge([kr[i] for i in kis], [tuple(k_segs[i]) for i in kis])
        calls.append(Call(q_rows, q_pos, k_rows, k_pos, masked))
    return calls


def ring_schedule(ring_layout: Sequence[Sequence[Segment]], ring_index: int, mask: Mask) -> List[List[Call]]:
    """Rank ``ring_index``'s calls at every ring step ``i`` (K/V block of ring rank ``(ring_index - i) % R``)."""
    R = len(ring_layout)
    return [step_calls(ring_layout[ring_index], ring_layout[(ring_index - i) % R], mask) for i in range(R)]


def schedule_work(sched: Sequence[Sequence[Call]]) -> int:
    return sum(c.work for step in sched for c in step)


def check_mask_len(mask: Mask, seq_len: int, what: str) -> None:
    if isinstance(mask, DocumentMask) and mask.seq_len != seq_len:
        raise ValueError(f"{what}: DocumentMask covers {mask.seq_len} positions (cu_seqlens[-1]) but the "
                         f"sequence has {seq_len}; expected cu_seqlens[-1] == {seq_len}")


__all__ = ["Mask", "NoMask", "CausalMask", "SlidingWindowMask", "DocumentMask", "as_mask", "Call", "EMPTY",
           "FULL", "PARTIAL", "step_calls", "ring_schedule", "schedule_work", "check_mask_len"]
