"""Framework-neutral planning for expert parallelism: checks, split math, the capacity rule.

Everything here is plain Python on ints and lists (no framework import), so the same
arithmetic imports no framework and can be tested without processes.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

# mesh dim names that hold different data than data parallelism would (a model-parallel dim):
# an EP mesh may not span them (tokens must be data-parallel across the EP ranks)
NON_DATA_PARALLEL_DIMS = ("tp", "pp")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_num_experts(num_experts: int, ep_degree: int, what: str = "ExpertParallel") -> int:
    """Experts per rank; a ``ValueError`` naming both numbers when ``ep_degree`` does not divide them."""
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"{what}: the number of experts must be a positive int, got {num_experts!r}")
    if not _is_int(ep_degree) or ep_degree < 1:
        raise ValueError(f"{what}: the EP degree must be a positive int, got {ep_degree!r}")
    if num_experts % ep_degree:
        raise ValueError(f"{what}: num_experts={num_experts} is not divisible by the EP degree {ep_degree} "
                         f"(the EP mesh size); uneven expert sharding is not supported: use a number of "
                         f"experts that is a multiple of {ep_degree}")
    return num_experts // ep_degree


def check_top_k(top_k: int, num_experts: int, what: str = "dispatch") -> int:
    if not _is_int(top_k) or top_k < 1:
        raise ValueError(f"{what}: top_k must be a positive int, got {top_k!r}")
    if top_k > num_experts:
        raise ValueError(f"{what}: top_k={top_k} is greater than num_experts={num_experts}; each token picks "
                         f"top_k distinct experts out of num_experts")
    return top_k


def check_capacity_factor(capacity_factor, what: str = "dispatch") -> Optional[float]:
    if capacity_factor is None:
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or \
            not capacity_factor > 0 or math.isinf(capacity_factor):
        raise ValueError(f"{what}: capacity_factor must be None (dropless) or a finite number > 0, got "
                         f"{capacity_factor!r}")
    return float(capacity_factor)


def check_ep_dim_names(names: Sequence[str], what: str = "ExpertParallel") -> None:
    """An EP mesh must be a view of data-parallel mesh dims: refuse a mesh dim named like a model-parallel one.

    ``names`` are the mesh dim names the EP mesh spans (a flattened mesh dim's name is split
    at ``_``). Unnamed mesh dims cannot be checked (nothing is known about them).
    """
    for name in names or ():
        if name is None:
            continue
        parts = str(name).split("_")
        bad = [p for p in parts if p in NON_DATA_PARALLEL_DIMS]
        if bad:
            raise ValueError(f"{what}: the EP mesh spans mesh dim {name!r}, a model-parallel dim ({bad[0]!r}); "
                             f"the EP mesh must be a sub-mesh of the data-parallel mesh dims (tokens are data-parallel "
                             f"across EP ranks), e.g. mesh['ep'] of ('dp', 'ep') or a view of dp_shard (x cp)")


def capacity(total_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert accepts per step: ``ceil(capacity_factor * total_tokens * top_k / num_experts)``.

    ``total_tokens`` counts the tokens of every EP rank (the global batch of the EP group), so
    the rule does not depend on the EP degree.
    """
    return int(math.ceil(capacity_factor * total_tokens * top_k / num_experts))


def kept_counts(counts: Sequence[Sequence[int]], cap: int) -> List[List[int]]:
    """The capacity rule: ``counts[r][e]`` assignments of source rank ``r`` to expert ``e`` -> how many are kept.

    Expert ``e`` keeps its first ``cap`` assignments in global token order: source rank order
    first (rank ``r``'s tokens come before rank ``r+1``'s, as in the concatenated global batch),
    then token order within the rank. The rest are dropped (their combine output is 0).
    """
    ranks = len(counts)
    num_experts = len(counts[0]) if ranks else 0
    out = [[0] * num_experts for _ in range(ranks)]
    for e in range(num_experts):
        left = cap
        for r in range(ranks):
            k = min(counts[r][e], max(left, 0))
            out[r][e] = k
            left -= k
    return out


def rank_splits(counts: Sequence[int], ep_degree: int) -> List[int]:
    """Rows sent to each EP rank: per-expert ``counts`` summed over each rank's block of experts."""
    per = len(counts) // ep_degree
    return [sum(counts[r * per:(r + 1) * per]) for r in range(ep_degree)]


def local_expert_range(num_experts: int, ep_degree: int, ep_rank: int) -> Tuple[int, int]:
    """``[start, stop)`` of the global expert ids held by ``ep_rank`` (contiguous blocks, Shard(0))."""
    per = num_experts // ep_degree
    return ep_rank * per, (ep_rank + 1) * per


def dispatch_bytes(tokens: int, top_k: int, hidden: int, itemsize: int) -> int:
    """Bytes of one token all_to_all buffer on a rank: ``tokens * top_k * hidden * itemsize`` (dropless)."""
    return tokens * top_k * hidden * itemsize


__all__ = ["check_num_experts", "check_top_k", "check_capacity_factor", "check_ep_dim_names", "capacity",
           "kept_counts", "rank_splits", "local_expert_range", "dispatch_bytes", "NON_DATA_PARALLEL_DIMS"]
