"""Framework-free bookkeeping for collectives: byte-cost formulas and recorders.

The redistribution planner predicts bytes with :func:`bytes_sent`, and the
ground floor (``distributed/``) reports every collective it issues to the active recorders with
the same formula, so a test can check that the executor did what the plan said.

"Bytes sent" is what one rank puts on the wire under a bandwidth-optimal
algorithm, given the buffer it hands to the collective:

========================  ==========================================
collective                bytes sent by one rank (k = group size)
========================  ==========================================
all_gather                input_bytes * (k - 1)
all_reduce                2 * input_bytes * (k - 1) // k
reduce_scatter            input_bytes * (k - 1) // k  (input = k chunks)
all_to_all                input_bytes * (k - 1) // k  (even split)
broadcast / scatter       root only: input_bytes * (k - 1) [// k]
reduce                    root: input_bytes * (k - 1) // k; others: input_bytes
gather                    others only: input_bytes
send                      input_bytes
========================  ==========================================

``is_src`` says whether this rank is the collective's root: the source of a
broadcast or scatter, the destination of a reduce or gather. ``reduce`` is
costed as a reduce_scatter followed by a gather of the reduced pieces to the root.
"""
from __future__ import annotations

from typing import Callable, List

ALL_GATHER = "all_gather"
ALL_REDUCE = "all_reduce"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"
BROADCAST = "broadcast"
SCATTER = "scatter"
REDUCE = "reduce"
GATHER = "gather"
SEND = "send"
RECV = "recv"

COLLECTIVES = (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST, SCATTER, REDUCE, GATHER, SEND, RECV)


def bytes_sent(kind: str, input_bytes: int, group_size: int, *, is_src: bool = True) -> int:
    """Bytes one rank sends for collective ``kind`` on an input buffer of ``input_bytes``."""
    k = group_size
    if k <= 1:
        return 0
    if kind == ALL_GATHER:
        return input_bytes * (k - 1)
    if kind == ALL_REDUCE:
        return 2 * input_bytes * (k - 1) // k
    if kind in (REDUCE_SCATTER, ALL_TO_ALL):
        return input_bytes * (k - 1) // k
    if kind == BROADCAST:
        return input_bytes * (k - 1) if is_src else 0
    if kind == SCATTER:
        return input_bytes * (k - 1) // k if is_src else 0
    if kind == REDUCE:
        return input_bytes * (k - 1) // k if is_src else input_bytes
    if kind == GATHER:
        return 0 if is_src else input_bytes
    if kind == SEND:
        return input_bytes
    if kind == RECV:
        return 0
    raise ValueError(f"bytes_sent: unknown collective kind {kind!r}; expected one of {COLLECTIVES}")


# Active recorders (CommDebugMode instances push a callback here). A plain list
# keeps the no-recorder fast path to one truthiness check.
_RECORDERS: List[Callable[[str, int, int, tuple], None]] = []


def record(kind: str, input_bytes: int, group_ranks: tuple, *, is_src: bool = True, sent: int = None) -> None:
    """Report one collective to every active recorder (no-op when none is active)."""
    if not _RECORDERS:
        return
    k = len(group_ranks)
    nbytes = bytes_sent(kind, input_bytes, k, is_src=is_src) if sent is None else sent
    for rec in list(_RECORDERS):
        rec(kind, nbytes, k, group_ranks)


def push_recorder(recorder) -> None:
    _RECORDERS.append(recorder)


def pop_recorder(recorder) -> None:
    _RECORDERS.remove(recorder)
