"""Grouped-expert modules: which modules hold every expert's weights, and how to trace them on meta.

Two calling contracts are recognised, both storing each weight as one ``[E, ...]`` parameter:

* the library's ``GroupedExperts`` (``hyper_parallel.moe``): ``forward(rows, num_tokens_per_expert)``, the rows
  already routed and sorted, weights ``w1``/``w3`` ``[E, hidden, dim]`` and ``w2`` ``[E, dim, hidden]``;
* Hugging Face transformers 5.x experts (``MixtralExperts``, ``Qwen3MoeExperts``, ``DeepseekV3Experts``, ...):
  ``forward(hidden_states [T, dim], top_k_index [T, k], top_k_weights [T, k])``, weights ``gate_up_proj``
  ``[E, 2 * hidden, dim]`` (fused gate and up; ``up_proj`` without a gate) and ``down_proj`` ``[E, dim, hidden]``
  (the transposes when the module's ``is_transposed`` is set), optional 2-D ``*_bias`` ``[E, out]``, and an
  ``act_fn`` child without parameters.

Routing is data dependent and torch's meta grouped-matmul kernel accepts bfloat16 only, so the trace replaces
an expert module's forward by a *balanced* stand-in: every routed row (``T * k`` of them) goes through one
expert's matrices with plain matmuls. The FLOPs are those of a balanced grouped matmul, the saved tensors
those of the real kernel, and it runs on meta in any dtype.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def is_grouped_experts(module: nn.Module) -> bool:
    """>= 2 direct parameters with one leading size E, at least two of them 3-D (``[E, out, in]``), and children
    (an activation) without parameters."""
    ps = list(module.parameters(recurse=False))
    if len(ps) < 2 or sum(1 for p in ps if p.dim() == 3) < 2 or any(p.dim() < 2 for p in ps):
        return False
    if any(True for c in module.children() for _ in c.parameters()):
        return False
    return len({p.shape[0] for p in ps}) == 1


def num_experts(module: nn.Module) -> int:
    return next(module.parameters()).shape[0]


def expert_hidden_size(module: nn.Module) -> int:
    """One expert's hidden (intermediate) size."""
    ps = dict(module.named_parameters(recurse=False))
    for attr in ("intermediate_dim", "intermediate_size", "moe_intermediate_size"):
        v = getattr(module, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    if "w1" in ps:
        return ps["w1"].shape[1]
    if "down_proj" in ps:
        down = ps["down_proj"]
        return down.shape[1] if getattr(module, "is_transposed", False) else down.shape[2]
    return min(p.shape[1] for p in ps.values() if p.dim() == 3)


def _matrices(mod: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p for n, p in mod.named_parameters(recurse=False) if p.dim() == 3}


def _project(rows: torch.Tensor, weight: torch.Tensor, transposed: Optional[bool]) -> torch.Tensor:
    """``x @ W^T`` for a ``[out, in]`` matrix (``x @ W`` for ``[in, out]``); ``transposed=None``: from the shapes."""
    if transposed is None:
        transposed = weight.shape[0] == rows.shape[-1] and weight.shape[1] != rows.shape[-1]
    return rows @ weight if transposed else rows @ weight.transpose(0, 1)


def _hf_gate(mod: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    if getattr(mod, "has_gate", True) and hasattr(mod, "_apply_gate"):
        return mod._apply_gate(hidden)
    act = getattr(mod, "act_fn", None) or F.silu
    if "gate_up_proj" in dict(mod.named_parameters(recurse=False)):
        gate, up = hidden.chunk(2, dim=-1)
        return act(gate) * up
    return act(hidden)


def _one_expert(mod: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` through expert 0's matrices (the FLOPs of a balanced grouped matmul over the same rows)."""
    ps = _matrices(mod)
    if {"w1", "w2", "w3"} <= set(ps):  # the library's SwiGLU experts: w1/w3 [E, hidden, dim], w2 [E, dim, hidden]
        h = F.silu(_project(rows, ps["w1"][0], False)) * _project(rows, ps["w3"][0], False)
        return _project(h, ps["w2"][0], False)
    up = ps.get("gate_up_proj", ps.get("up_proj"))
    if up is not None and "down_proj" in ps:  # Hugging Face experts
        transposed = getattr(mod, "is_transposed", None)
        h = _project(rows, up[0], transposed)
        return _project(_hf_gate(mod, h), ps["down_proj"][0], transposed)
    h = rows
    for n in sorted(ps):  # another layout: chain expert 0's matrices in name order
        h = _project(h, ps[n][0], None)
    return h


def balanced_experts_forward(mod: nn.Module):
    """A forward for ``mod`` that traces on meta in any dtype (see the module docstring)."""

    def forward(hidden_states, routing=None, weights=None, *args, **kwargs):
        routing = kwargs.pop("top_k_index", routing)
        weights = kwargs.pop("top_k_weights", weights)
        try:
            if isinstance(routing, torch.Tensor) and routing.dim() == 2 \
                    and routing.shape[0] == hidden_states.shape[0] and isinstance(weights, torch.Tensor):
                tokens, k = routing.shape  # Hugging Face contract: each token goes to k experts
                rows = hidden_states[:, None, :].expand(tokens, k, hidden_states.shape[-1]).reshape(
                    tokens * k, hidden_states.shape[-1])
                out = _one_expert(mod, rows).view(tokens, k, -1)
                return (out * weights[..., None].to(out.dtype)).sum(dim=1).to(hidden_states.dtype)
            return _one_expert(mod, hidden_states)  # GroupedExperts contract: the rows are already routed
        except RuntimeError as err:
            shapes = {n: tuple(p.shape) for n, p in mod.named_parameters(recurse=False)}
            raise ValueError(
                f"plan(): {type(mod).__name__} holds [E, ...] parameters {shapes}, so the trace runs it as grouped "
                f"experts on input {tuple(hidden_states.shape)}, but its matrices do not chain ({err}); the planner "
                "knows hyper_parallel.moe.GroupedExperts (w1/w2/w3) and Hugging Face's experts (gate_up_proj or "
                "up_proj, then down_proj)") from err
    return forward
