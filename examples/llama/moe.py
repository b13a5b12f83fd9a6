"""Mixture-of-experts feed-forward for the example Llama (DeepSeek-V3 / torchtitan style, plain PyTorch).

One MoE layer, for the tokens x [bs, slen, dim] of this rank:

1. **Router** (:class:`TokenChoiceTopKRouter`): ``scores = softmax|sigmoid(gate(x))`` [T, E];
   each token picks ``top_k`` experts by ``scores + expert_bias`` (the bias steers the choice
   only; the gate weights are the unbiased scores). With ``n_groups > 1`` (DeepSeek-V3's
   group-limited routing) the experts form ``n_groups`` equal groups, each group is scored by
   the sum of its two best (biased) scores, and the top_k experts are chosen only inside the
   ``topk_groups`` best groups. ``route_norm`` rescales a token's top_k weights to sum 1;
   ``route_scale`` multiplies them.
2. **Reordering** (:func:`reorder_tokens`): the T*top_k (token, expert) pairs are sorted by
   expert id (stable), giving ``routed_input`` [T*top_k, dim] grouped by expert in increasing
   order and ``num_tokens_per_expert`` [E].
3. **Experts** (:class:`GroupedExperts`, torchtitan's contract): 3-D parameters ``w1``, ``w3``
   [E, hidden, dim] and ``w2`` [E, dim, hidden]; ``forward(routed_input, num_tokens_per_expert)``
   runs expert e's SwiGLU on its rows and returns [T*top_k, dim] in the same row order. Expert
   parallelism (``hyper_parallel.moe.ExpertParallel``) wraps exactly this forward: it shards the
   3-D parameters ``Shard(0)`` on the ep mesh and all-to-alls the rows to the ranks holding their
   experts and back, so the model code is the same with and without EP.
4. **Combine**: each expert output row is multiplied by its routing weight and added
   (``index_add``) to its token's row of the shared expert's output (``n_shared_experts``
   SwiGLU of width ``n_shared_experts * hidden`` that every token goes through).

Balancing (no tokens are dropped):

* **aux-loss-free** (DeepSeek-V3): ``expert_bias`` [E] (a persistent buffer, so it is
  checkpointed) is updated after every optimizer step by :func:`update_expert_bias` from the
  GLOBAL token counts of the step: ``bias += coeff * sign(mean(counts) - counts)`` (centred;
  the library's ``hyper_parallel.moe.update_expert_bias``). The counts of all MoE layers travel in
  ONE all_reduce over the data-parallel ranks.
* **auxiliary loss** (optional, ``aux_loss_coeff > 0``): DeepSeek-V3's sequence-wise balance
  loss ``coeff * mean_over_sequences(sum_e f_e * P_e)`` (``f_e``: the sequence's fraction of
  choices that went to e, times E/top_k; ``P_e``: its mean normalised score of e). Per sequence,
  so it is the same whichever data-parallel rank holds the sequence. It is added to the gradient
  only (:class:`_AddAuxLoss`), so the reported loss stays the cross-entropy.

:func:`expert_load` turns the counts into per-step metrics (tokens per expert, max/mean).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from hyper_parallel.moe import grouped_mm, update_expert_bias as _bias_step


@dataclass
class MoEArgs:
    """Hyperparameters of the MoE feed-forward (names follow torchtitan's ``MoEArgs``)."""

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 64  # each routed expert's SwiGLU width
    n_shared_experts: int = 1  # 0: no shared expert
    score_func: str = "softmax"  # "softmax" or "sigmoid"
    route_norm: bool = False  # rescale each token's top_k weights to sum 1
    route_scale: float = 1.0
    n_groups: int = 1  # > 1: DeepSeek-V3 group-limited routing over this many expert groups
    topk_groups: int = 1  # groups a token may route into (with n_groups > 1)
    load_balance_coeff: Optional[float] = 1e-3  # aux-loss-free bias step; None: no expert_bias
    aux_loss_coeff: float = 0.0  # > 0: add the sequence-wise balance loss

    def __post_init__(self):
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        if self.n_groups < 1 or self.num_experts % self.n_groups:
            raise ValueError(f"n_groups={self.n_groups} must be >= 1 and divide num_experts={self.num_experts}")
        if self.n_groups > 1:
            per_group = self.num_experts // self.n_groups
            if not 1 <= self.topk_groups <= self.n_groups:
                raise ValueError(f"topk_groups={self.topk_groups} must be in [1, n_groups={self.n_groups}]")
            if self.topk_groups * per_group < self.top_k:
                raise ValueError(f"topk_groups={self.topk_groups} groups of {per_group} experts hold fewer than "
                                 f"top_k={self.top_k} experts")
        if self.load_balance_coeff is not None and self.load_balance_coeff <= 0:
            raise ValueError(f"load_balance_coeff must be > 0 or None, got {self.load_balance_coeff}")
        if self.aux_loss_coeff < 0:
            raise ValueError(f"aux_loss_coeff must be >= 0, got {self.aux_loss_coeff}")


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): the shared expert (same names as the dense ``FeedForward``)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def run_experts_loop(w1, w2, w3, x, num_tokens_per_expert):
    """Expert e's SwiGLU on its rows of ``x`` (rows grouped by expert, counts in ``num_tokens_per_expert``).

    A plain loop (one host read of the counts); the reference ``hyper_parallel.moe.grouped_mm`` is
    checked against in tests/moe/test_moe_model.py (``GroupedExperts(use_grouped_mm=False)`` uses it).
    """
    counts = [int(c) for c in num_tokens_per_expert.tolist()]
    if sum(counts) != x.shape[0]:
        raise ValueError(f"GroupedExperts: num_tokens_per_expert sums to {sum(counts)}, but routed_input has "
                         f"{x.shape[0]} rows")
    outs = []
    for e, xe in enumerate(torch.split(x, counts, dim=0)):
        h = F.silu(xe @ w1[e].transpose(0, 1)) * (xe @ w3[e].transpose(0, 1))
        outs.append(h @ w2[e].transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else x.new_zeros(x.shape)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as 3-D parameters: torchtitan's GroupedExperts contract.

    ``w1``, ``w3``: [E, hidden, dim]; ``w2``: [E, dim, hidden]. ``forward(routed_input,
    num_tokens_per_expert)`` with rows grouped by expert id in increasing order. When expert
    parallelism made the parameters DTensors (``Shard(0)`` on the ep mesh), the forward sees
    only its local experts: it computes on ``.to_local()`` and ``num_tokens_per_expert`` has one
    entry per local expert.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.use_grouped_mm = use_grouped_mm

    def forward(self, routed_input: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        if num_tokens_per_expert.numel() != w1.shape[0]:
            raise ValueError(f"GroupedExperts: num_tokens_per_expert has {num_tokens_per_expert.numel()} entries "
                             f"for {w1.shape[0]} (local) experts")
        if not self.use_grouped_mm:
            return run_experts_loop(w1, w2, w3, routed_input, num_tokens_per_expert)
        offsets = torch.cumsum(num_tokens_per_expert, dim=0).to(torch.int32)
        if routed_input.shape[0] != (int(offsets[-1]) if offsets.numel() else 0):
            raise ValueError(f"GroupedExperts: num_tokens_per_expert sums to {int(offsets[-1])}, but routed_input "
                             f"has {routed_input.shape[0]} rows")
        # hyper_parallel.moe.grouped_mm: torch._grouped_mm where torch runs it (CUDA), an exact loop elsewhere
        h = F.silu(grouped_mm(routed_input, w1.transpose(-2, -1), offsets))
        h = h * grouped_mm(routed_input, w3.transpose(-2, -1), offsets)
        return grouped_mm(h, w2.transpose(-2, -1), offsets)


class TokenChoiceTopKRouter(nn.Module):
    """Token-choice top-k routing; returns (weights [T, k], expert ids [T, k], scores [T, E])."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.args = args

    def forward(self, x: torch.Tensor, expert_bias: Optional[torch.Tensor] = None):
        a = self.args
        logits = self.gate(x)
        # scores in at least fp32 (float64 stays float64)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scores = torch.sigmoid(logits) if a.score_func == "sigmoid" else F.softmax(logits, dim=-1)
        with torch.no_grad():
            choice = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
            if a.n_groups > 1:
                choice = group_limited(choice, a.n_groups, a.topk_groups)
            ids = torch.topk(choice, k=a.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if a.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, ids, scores


def group_limited(choice: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """DeepSeek-V3: keep the experts of the ``topk_groups`` best groups (group score: the sum of its two
    best scores, or its best when a group has one expert); the rest get -inf."""
    t, e = choice.shape
    grouped = choice.view(t, n_groups, e // n_groups)
    group_scores = grouped.topk(min(2, e // n_groups), dim=-1).values.sum(dim=-1)  # [T, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)


def reorder_tokens(ids: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T*k (token, expert) pairs by expert id (stable).

    Returns (order [T*k]: positions into ``ids.view(-1)``, token index of each sorted pair [T*k],
    num_tokens_per_expert [E] int64).
    """
    flat = ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"expert ids must be in [0, {num_experts}), got min {int(flat.min())} "
                         f"max {int(flat.max())}")
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // ids.shape[-1], counts


class _AddAuxLoss(torch.autograd.Function):
    """Identity on ``out``; backward also sends gradient 1 into ``aux`` (so d(aux)/d(params) is added)."""

    @staticmethod
    def forward(ctx, out, aux):
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def sequence_aux_loss(scores: torch.Tensor, ids: torch.Tensor, bs: int, num_experts: int,
                      top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (without its coefficient): mean over the ``bs``
    sequences of sum_e f_e * P_e; scores [bs*slen, E], ids [bs*slen, k]."""
    s = scores.view(bs, -1, num_experts)
    p = (s / s.sum(dim=-1, keepdim=True)).mean(dim=1)  # [bs, E]
    onehot = torch.zeros(bs, s.shape[1] * top_k, num_experts, dtype=s.dtype, device=s.device)
    onehot.scatter_(2, ids.view(bs, -1, 1), 1.0)
    f = onehot.mean(dim=1) * num_experts  # [bs, E]: E * count_e / (slen * top_k)
    return (f * p).sum(dim=-1).mean()


class MoE(nn.Module):
    """Routed experts + shared expert, dropless; ``forward`` takes and returns [bs, slen, dim]."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = TokenChoiceTopKRouter(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts)
        self.shared_experts = SwiGLU(dim, args.hidden_dim * args.n_shared_experts) if args.n_shared_experts else None
        if args.load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        else:
            self.expert_bias = None
        # this rank's choices per expert since the last bias update (not checkpointed)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.last_aux_loss: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, ids, scores = self.router(flat, self.expert_bias)
        order, token_idx, counts = reorder_tokens(ids, self.args.num_experts)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
        routed_out = self.experts(flat[token_idx], counts)
        routed_out = routed_out * weights.reshape(-1)[order].unsqueeze(-1).to(routed_out.dtype)
        out = self.shared_experts(flat) if self.shared_experts is not None else torch.zeros_like(flat)
        out = out.index_add(0, token_idx, routed_out.to(out.dtype))
        out = out.view(bs, slen, dim)
        if self.args.aux_loss_coeff > 0 and torch.is_grad_enabled():
            aux = sequence_aux_loss(scores, ids, bs, self.args.num_experts, self.args.top_k)
            aux = aux * self.args.aux_loss_coeff
            self.last_aux_loss = aux.detach()
            out = _AddAuxLoss.apply(out, aux)
        return out

    @torch.no_grad()
    def init_weights(self, gen: torch.Generator, fill, std: float, out_std: float) -> None:
        """Draw this layer's weights from ``gen`` in a fixed order with ``fill(param, gen, std)``."""
        fill(self.router.gate.weight, gen, std)
        fill(self.experts.w1, gen, std)
        fill(self.experts.w3, gen, std)
        fill(self.experts.w2, gen, out_std)
        if self.shared_experts is not None:
            fill(self.shared_experts.w1.weight, gen, std)
            fill(self.shared_experts.w3.weight, gen, std)
            fill(self.shared_experts.w2.weight, gen, out_std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
        self.tokens_per_expert.zero_()


def moe_layers(model: nn.Module) -> List[Tuple[str, MoE]]:
    """The model's MoE modules with their names, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_expert_bias(model: nn.Module, group=None) -> Dict[str, torch.Tensor]:
    """Aux-loss-free balancing step; call after ``optimizer.step()``.

    Sums every MoE layer's ``tokens_per_expert`` over ``group`` (the data-parallel ranks; None:
    no communication) in ONE all_reduce, moves each ``expert_bias`` by
    ``coeff * sign(mean - count)`` minus its mean, zeroes the counts, and returns the global
    counts per layer name (for :func:`expert_load`). The tensor-parallel ranks of one data-parallel
    rank hold the same counts, so ``group`` must not include them.
    """
    layers = moe_layers(model)
    if not layers:
        return {}
    counts = torch.cat([m.tokens_per_expert for _, m in layers])
    if group is not None:
        import torch.distributed as dist  # noqa: PLC0415
        if dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
    out = {}
    for (name, m), c in zip(layers, counts.split([m.args.num_experts for _, m in layers])):
        out[name] = c.clone()
        if m.expert_bias is not None:  # the library's DeepSeek-V3 step: coeff * (sign(mean - c) - its mean)
            _bias_step(m.expert_bias, c, m.args.load_balance_coeff)
        m.tokens_per_expert.zero_()
    return out


def expert_load(counts: Dict[str, torch.Tensor]) -> Dict[str, Tuple[List[int], float]]:
    """Per layer: (tokens per expert, max/mean imbalance; 1.0 is perfectly balanced)."""
    out = {}
    for name, c in counts.items():
        mean = float(c.mean())
        out[name] = ([int(v) for v in c.tolist()], float(c.max()) / mean if mean > 0 else math.nan)
    return out


def format_load(counts: Dict[str, torch.Tensor]) -> str:
    """One line: each MoE layer's max/mean and its tokens per expert."""
    parts = []
    for name, (tokens, imb) in expert_load(counts).items():
        short = name.replace("layers.", "L").replace(".moe", "")
        parts.append(f"{short} max/mean {imb:.2f} {tokens}")
    return "expert load: " + "; ".join(parts)
