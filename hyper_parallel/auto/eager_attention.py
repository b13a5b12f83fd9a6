"""Attention written without ``F.scaled_dot_product_attention`` ("eager": ``softmax(q @ k^T) @ v``), as Hugging
Face runs models that have no sdpa path (Gemma-2's soft-capping, GPT-OSS's sinks) and as hand-written models do.

The planner finds attention where sdpa ran (``model_stats``); this spy reports the other form to the same
bookkeeping: the first matmul of two 4-D activations ``[batch, heads, seq, head_dim] @ [batch, heads, head_dim,
seq]`` (no parameter on either side) is the attention's score product, ``q`` its left operand and ``k`` its right
one transposed back. Its FLOPs are counted as the matmuls they are by the flop counter; only the position of
the attention among the module's Linears and the head shapes are taken from here.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


def _activation_4d(value) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.dim() == 4


class EagerAttentionSpy(TorchFunctionMode):
    """Calls ``on_scores(q_shape, k_shape)`` for every ``q @ k^T`` of 4-D activations (see the module docstring);
    ``active()`` says whether to look (the forward pass, outside sdpa)."""

    def __init__(self, on_scores: Callable[[tuple, tuple], None], active: Callable[[], bool]):
        super().__init__()
        self.on_scores = on_scores
        self.active = active

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and len(args) == 2 and self.active():
            q, kt = args
            if _activation_4d(q) and _activation_4d(kt) and q.shape[-1] == kt.shape[-2] \
                    and q.shape[-2] == kt.shape[-1] and q.shape[0] == kt.shape[0]:
                k_shape = tuple(kt.shape[:-2]) + (kt.shape[-1], kt.shape[-2])
                self.on_scores(tuple(q.shape), k_shape)
        return func(*args, **kwargs)
