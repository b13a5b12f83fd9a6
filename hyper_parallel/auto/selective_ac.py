"""Selective activation checkpointing: a block's forward under ``torch.utils.checkpoint`` with an op-level
policy (torchtitan's op SAC): the outputs of matmuls and attention are saved, everything else (norms,
activations, rotary, residual adds, reshapes) is recomputed in backward from them.

Memory (``selective_saved``): per block, the checkpoint's input plus the saved op outputs instead of every
tensor autograd keeps; backward recomputes one block at a time. Compute: the recomputed ops are the cheap
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


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts():
    return create_selective_checkpoint_contexts(_policy)


def checkpoint_selective(block: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``block.forward`` in a non-reentrant checkpoint that saves matmul and attention outputs."""
    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, context_fn=_contexts)
    return block
