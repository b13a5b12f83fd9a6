"""Top-k token-choice routing (torchtitan's TokenChoiceTopKRouter / DeepSeek-V3's gate), as one function."""
from __future__ import annotations

from typing import Optional

import torch


def route_topk(logits: torch.Tensor, top_k: int, *, score_func: str = "softmax",
               expert_bias: Optional[torch.Tensor] = None, num_groups: Optional[int] = None,
               top_groups: Optional[int] = None, normalize: bool = None, scale: float = 1.0):
    """``(weights [T, top_k], expert_ids [T, top_k])`` from router ``logits`` ``[T, E]``.

    * ``score_func``: ``"softmax"`` (over the experts) or ``"sigmoid"`` (per expert), computed in float32;
    * ``expert_bias`` ``[E]`` (aux-loss-free balancing, :func:`~.balance.update_expert_bias`) is added to
      the scores for the *selection* only; the weights are the unbiased scores of the chosen experts;
    * group-limited routing (DeepSeek-V3): the experts form ``num_groups`` equal groups, a group's score
      is the sum of its two best (biased) scores, only the ``top_groups`` best groups are eligible;
    * ``normalize`` (default: True for sigmoid, False for softmax) divides the weights by their sum;
      ``scale`` multiplies them. Weights are returned in ``logits``' dtype.
    """
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"route_topk: score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    T, E = logits.shape
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= E:
        raise ValueError(f"route_topk: top_k={top_k!r} must be an int in [1, num_experts={E}]")
    scores = logits.float().softmax(-1) if score_func == "softmax" else logits.float().sigmoid()
    choice = scores if expert_bias is None else scores + expert_bias.float()
    if num_groups is not None:
        if E % num_groups or not top_groups or not 1 <= top_groups <= num_groups:
            raise ValueError(f"route_topk: num_groups={num_groups} must divide num_experts={E} and top_groups="
                             f"{top_groups!r} be in [1, num_groups]")
        per = E // num_groups
        if top_k > top_groups * per:
            raise ValueError(f"route_topk: top_k={top_k} exceeds the {top_groups * per} experts of the "
                             f"top_groups={top_groups} eligible groups")
        grouped = choice.view(T, num_groups, per)
        gscore = grouped.topk(min(2, per), dim=-1).values.sum(-1)
        keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gscore.topk(top_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if normalize if normalize is not None else score_func == "sigmoid":
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return (w * scale).to(logits.dtype), ids
