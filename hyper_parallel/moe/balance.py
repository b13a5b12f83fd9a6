"""Load balancing helpers: global token counts, DeepSeek-V3's aux-loss-free bias update, an auxiliary
loss, and load metrics.
"""
from __future__ import annotations

from typing import Optional

import torch

from hyper_parallel.moe import comm
from hyper_parallel.moe.token_exchange import count_ids


def _groups(mesh):
    """Comm groups of every mesh dim of ``mesh`` (``None``: none; a list/tuple of meshes: all of theirs)."""
    if mesh is None:
        return []
    if isinstance(mesh, (list, tuple)):
        return [g for m in mesh for g in _groups(m)]
    from hyper_parallel.dtensor.device_mesh import DeviceMesh, adopt_foreign_mesh
    m = mesh if isinstance(mesh, DeviceMesh) else adopt_foreign_mesh(mesh)
    if m is None:
        raise TypeError(f"expected a DeviceMesh (or a list of them) or None, got {mesh!r}")
    return [m.get_comm_group(d) for d in range(m.ndim)]


def tokens_per_expert(expert_ids_or_counts: torch.Tensor, num_experts: Optional[int] = None, mesh=None):
    """Tokens routed to each expert, summed over ``mesh`` (every mesh dim of it; one small all_reduce per mesh dim).

    Pass the router's ``[T, top_k]`` expert ids with ``num_experts``, or this rank's ``[E]`` counts.
    ``mesh`` is the group whose tokens count together: the data-parallel ranks that route different
    tokens (e.g. the whole ``("dp", "ep")`` mesh); ``None``: this rank's tokens only. Returns an int64
    ``[E]`` tensor (no gradient).
    """
    t = expert_ids_or_counts.detach()
    if t.dim() == 2 or num_experts is not None and t.dim() != 1:
        if num_experts is None:
            raise ValueError("tokens_per_expert: num_experts is required with [T, top_k] expert ids")
        counts = count_ids(t.reshape(-1), num_experts)
    elif t.dim() == 1:
        counts = t.to(torch.int64)
    else:
        raise ValueError(f"tokens_per_expert: expected [T, top_k] ids or [E] counts, got shape {tuple(t.shape)}")
    for g in _groups(mesh):
        counts = comm.all_reduce_sum(counts, g)
    return counts


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, global_tokens_per_expert: torch.Tensor, coeff: float = 1e-3):
    """DeepSeek-V3's aux-loss-free balancing: ``bias += coeff * sign(mean - tokens)``, centred (in place).

    Experts above the mean load get their routing bias lowered, those below raised. The bias only
    enters the top-k *selection* (not the weights). ``global_tokens_per_expert`` must be the counts of
    the whole data-parallel batch (:func:`tokens_per_expert` with the dp mesh) so every rank applies
    the same update. Returns ``bias``.
    """
    if bias.shape != global_tokens_per_expert.shape:
        raise ValueError(f"update_expert_bias: bias {tuple(bias.shape)} and tokens_per_expert "
                         f"{tuple(global_tokens_per_expert.shape)} must have the same shape [E]")
    counts = global_tokens_per_expert.to(torch.float64)
    delta = torch.sign(counts.mean() - counts)
    delta = (delta - delta.mean()) * coeff
    target = bias.to_local() if hasattr(bias, "to_local") else bias
    target.add_(delta.to(device=target.device, dtype=target.dtype))
    return bias


def load_balance_loss(scores: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss on this rank's tokens: ``E * sum_e f_e * p_e``.

    ``f_e``: fraction of the ``T * top_k`` assignments that went to expert ``e`` (no gradient);
    ``p_e``: mean over tokens of the (normalised) router score of ``e``. Equals 1 for a uniform
    router; multiply by a small coefficient and add to the loss.
    """
    T, k = expert_ids.shape
    f = count_ids(expert_ids.reshape(-1), num_experts).to(scores.dtype) / (T * k)
    p = scores / scores.sum(-1, keepdim=True)
    return num_experts * (f.detach() * p.mean(0)).sum()


def load_metrics(tokens_per_expert_counts) -> dict:
    """``{"tokens_per_expert": [...], "max": m, "mean": a, "imbalance": m / a}`` (host values)."""
    c = tokens_per_expert_counts
    vals = comm.to_host(c) if isinstance(c, torch.Tensor) else list(c)
    mean = sum(vals) / len(vals) if vals else 0.0
    mx = max(vals) if vals else 0
    return {"tokens_per_expert": vals, "max": mx, "mean": mean, "imbalance": (mx / mean) if mean else 0.0}
