"""Selective activation checkpointing: a block's forward under ``torch.utils.checkpoint`` with an op-level
policy (torchtitan's op SAC): the outputs of matmuls and attention are saved, everything else (norms,
activations, rotary, residual adds, reshapes) is recomputed in backward from them.

Memory (``selective_per_sample``): per block, the checkpoint's input plus the saved op outputs instead of every
tensor autograd keeps; backward recomputes one block at a time (its other activations, next to its saved ones). Compute: the recomputed ops are the cheap
ones (no matmul FLOPs are repeated), so the planner adds only their per-op host cost.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten
SAVE_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
for _name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable"):
    if hasattr(_aten, _name):
        SAVE_OPS.add(getattr(_aten, _name).default)


def _policy(ctx, aten_op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if aten_op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts():
    return create_selective_checkpoint_contexts(_policy)


def checkpoint_selective(block: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``block.forward`` in a non-reentrant checkpoint that saves matmul and attention outputs."""
    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, context_fn=_contexts)
    return block


_SPLIT_ROLES = {"attention_q", "attention_k", "attention_v", "mlp_gate", "mlp_up", "attention_qkv", "attention_kv",
                "mlp_gate_up"}


def block_sac_bytes(info, trace):
    """Per block, per sample: (bytes split by tp, bytes whole under tp) of what selective AC saves. Colwise
    projections' outputs and attention's (heads) are split over tp; rowwise projections' outputs (partial sums
    of the whole hidden state, before their reduction), the router's and the grouped experts' (replicated over
    tp) are whole."""
    out = []
    for b in info.block_names:
        split = whole = 0
        for f, t in trace.modules.items():
            if not t.sac_bytes or not (f == b or f.startswith(b + ".")):
                continue
            if info.module_roles.get(f) in _SPLIT_ROLES or f in info.attention_modules:
                split += t.sac_bytes
            else:
                whole += t.sac_bytes
        out.append((split / trace.batch, whole / trace.batch))
    return out


def selective_per_sample(summary, stages, tp_size, sp_div, cp_size, hidden):
    """Activation bytes per sample of a rank's ``stages`` (``cost._stages`` entries) under selective AC: each
    block keeps its input (``hidden`` bytes per sample, already divided by cp; split by sp) and the saved op
    outputs; backward re-materializes one block at a time (the largest block's activations less what it saved)."""
    kept, working = selective_parts(summary, stages, tp_size, sp_div, cp_size, hidden)
    return kept + working


def selective_parts(summary, stages, tp_size, sp_div, cp_size, hidden):
    """(bytes per sample kept per in-flight microbatch, bytes per sample of the one block backward
    re-materializes at a time) under selective AC (see :func:`selective_per_sample`)."""
    sac = summary.__dict__.get("blk_sac")
    if sac is None:
        raise ValueError("selective activation checkpointing: the model summary has no selective-AC trace "
                         "(hyper_parallel.auto.selective_ac.block_sac_bytes)")
    total, biggest = 0.0, 0.0
    for st in stages:
        for i in st["blocks"]:
            split, whole = sac[i]
            saved = (split / tp_size + whole) / cp_size
            total += hidden / sp_div + saved
            # backward re-materializes block i's other activations next to its saved outputs (reused, not copied)
            full = (summary.blk_inner[i] / tp_size + summary.blk_outer[i] / sp_div + summary.blk_gathered[i]) / cp_size
            biggest = max(biggest, full - saved)
    return total, biggest
