"""What intercepted ``F.scaled_dot_product_attention`` calls do (``ContextParallel``, ``context_parallel``)."""
from __future__ import annotations

import threading

from hyper_parallel.context_parallel.api import context_parallel_attention
from hyper_parallel.context_parallel.masks import CausalMask, NoMask, as_mask
from hyper_parallel.context_parallel import torch_mechanics as _tm

_MASK = threading.local()


class attention_mask:
    """``with attention_mask(DocumentMask(...)):`` - the mask intercepted ``F.scaled_dot_product_attention``
    calls (``ContextParallel``, ``context_parallel``) use when they pass neither ``attn_mask`` nor
    ``is_causal`` (SDPA has no argument for a document or sliding-window mask)."""

    def __init__(self, mask):
        self.mask = as_mask(mask, "attention_mask")

    def __enter__(self):
        stack = getattr(_MASK, "stack", None)
        if stack is None:
            stack = _MASK.stack = []
        stack.append(self.mask)
        return self.mask

    def __exit__(self, *exc):
        _MASK.stack.pop()
        return False


def _active_mask():
    stack = getattr(_MASK, "stack", None)
    return stack[-1] if stack else None


def sdpa_handler(mesh, method, load_balance, rotate=None, what="context-parallel SDPA"):
    """A handler for intercepted ``F.scaled_dot_product_attention(q, k, v, ...)`` calls on ``mesh``."""

    def handler(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        impl = _tm
        if impl.is_compiling():
            # torch.compile: one opaque op (no DeviceMesh or p2p in the traced region); it runs `eager`
            _check(attn_mask, dropout_p, query, key, enable_gqa)
            return impl.opaque_sdpa(hid, query, key, value, is_causal, scale, enable_gqa)
        return eager(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def _check(attn_mask, dropout_p, query, key, enable_gqa):
        if dropout_p:
            raise NotImplementedError(f"{what}: dropout_p={dropout_p} > 0 is not supported under context "
                                      "parallelism (expected dropout_p=0.0)")
        _check_mask_gqa(attn_mask, query, key, enable_gqa)

    def _check_mask_gqa(attn_mask, query, key, enable_gqa):
        if attn_mask is not None:
            raise NotImplementedError(
                f"{what}: an attn_mask tensor cannot be honoured under context parallelism (each rank holds a "
                "sequence shard; a dense mask is never silently dropped); use is_causal=True, or "
                "hyper_parallel.context_parallel.attention_mask(DocumentMask(...) | SlidingWindowMask(w))")
        hq, hk = query.shape[-3], key.shape[-3]
        if hq != hk and not enable_gqa:
            raise ValueError(f"{what}: query has {hq} heads and key/value {hk}; pass enable_gqa=True for "
                             "grouped-query attention (as F.scaled_dot_product_attention requires)")

    def eager(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              compiled=False):
        _check_mask_gqa(attn_mask, query, key, enable_gqa)
        extra = _active_mask()
        if compiled and extra is not None and not isinstance(extra, NoMask):
            raise NotImplementedError(f"{what}: attention_mask({extra!r}) is not supported inside torch.compile "
                                      "(the compiled context-parallel SDPA op supports is_causal=True or no mask); "
                                      "run this attention eagerly")
        if extra is not None and not isinstance(extra, NoMask):
            if is_causal and not extra.causal:
                raise ValueError(f"{what}: is_causal=True contradicts the active non-causal mask {extra!r}")
            mask = extra
        else:
            mask = CausalMask() if is_causal else NoMask()
        return context_parallel_attention(query, key, value, mesh, method=method, mask=mask, scale=scale,
                                          load_balance=load_balance, rotate=rotate, dropout_p=dropout_p)

    hid = _tm.register_sdpa_handler(eager)
    return handler


__all__ = ["attention_mask", "sdpa_handler"]
