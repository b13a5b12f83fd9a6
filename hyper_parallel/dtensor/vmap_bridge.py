"""``torch.vmap`` over DTensors: map the aten op a batching rule issues back to a torch-level function.

Why: DTensor ops are dispatched in ``__torch_function__`` (keyed by torch functions). Under
``torch.vmap`` the batching rules run below that and hand *aten* ops (``aten.mul.Tensor``,
``aten.embedding.default``...) to the DTensor wrapper's ``__torch_dispatch__``, with the batch
dimension physically present in the DTensor. For ops whose aten schema matches the torch
function of the same name (elementwise ops, reductions, views, embedding...), running that
torch function through the normal DTensor dispatch gives the batched result with the right
layout. Ops without such a twin get None here, and the caller raises a clear error naming vmap.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# aten ops whose torch function of the same name has another signature: (function, argument reordering)
_RENAMED = {
    "embedding": (F.embedding, lambda weight, indices, *rest: (indices, weight)),
    "_unsafe_view": (torch.Tensor.reshape, lambda self, size: (self, size)),
    "_softmax": (torch.softmax, lambda self, dim, half_to_float=False: (self, dim)),
    "_log_softmax": (torch.log_softmax, lambda self, dim, half_to_float=False: (self, dim)),
}


def translate(aten_op, args):
    """``(torch_function, args)`` doing what ``aten_op(*args)`` does, or None when there is no such twin."""
    name = getattr(getattr(aten_op, "overloadpacket", None), "__name__", None)
    if name is None:
        return None
    if name in _RENAMED:
        fn, reorder = _RENAMED[name]
        return fn, reorder(*args)
    fn = getattr(torch, name, None)
    if fn is None:
        fn = getattr(torch.Tensor, name, None)
    return (fn, tuple(args)) if callable(fn) else None
