"""Communication volume of context-parallel attention (bytes one rank sends), the formulas of the docs.

``b_kv(r)`` = bytes of ring rank r's packed K and V shard; ``P`` = cp degree (ring size R, Ulysses
size U). The tests count the recorded collectives (distributed/comm_record.py) and compare with these.
"""
from __future__ import annotations

from typing import Dict, Sequence


def ring_forward(kv_bytes: Sequence[int], ring_index: int, rotate: str) -> Dict[str, int]:
    """Forward: ``p2p`` sends the block it holds at steps 0..R-2 (its own, then the ones received);
    ``allgather`` sends its own (padded to the largest) to R-1 peers."""
    R = len(kv_bytes)
    if R == 1:
        return {"count": 0, "bytes": 0}
    if rotate == "p2p":
        return {"count": R - 1, "bytes": sum(kv_bytes[(ring_index - i) % R] for i in range(R - 1))}
    return {"count": 1, "bytes": max(kv_bytes) * (R - 1)}


def ring_backward_p2p(kv_bytes: Sequence[int], dkv_bytes: Sequence[int], ring_index: int) -> Dict[str, int]:
    """Backward (p2p): K/V rotate again (R-1 sends) and each block's dK/dV accumulator moves R times."""
    R = len(kv_bytes)
    kv = sum(kv_bytes[(ring_index - i) % R] for i in range(R - 1))
    dkv = sum(dkv_bytes[(ring_index - i) % R] for i in range(R))
    return {"count": 2 * R - 1, "bytes": kv + dkv}


def ulysses_forward(q_bytes: int, k_bytes: int, v_bytes: int, o_bytes: int, ulysses_size: int) -> Dict[str, int]:
    """Forward: all_to_alls of q, k, v (after GQA repetition) and the output: ``(U-1)/U`` of each (even split)."""
    if ulysses_size == 1:
        return {"count": 0, "bytes": 0}
    return {"count": 4,
            "bytes": sum(b * (ulysses_size - 1) // ulysses_size for b in (q_bytes, k_bytes, v_bytes, o_bytes))}


__all__ = ["ring_forward", "ring_backward_p2p", "ulysses_forward"]
