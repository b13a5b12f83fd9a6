"""Routing ``F.scaled_dot_product_attention`` calls to context-parallel attention.

A ``TorchFunctionMode`` sees every call of ``torch.nn.functional.scaled_dot_product_attention``
(``torch._C._nn.scaled_dot_product_attention``, however it is reached) while it is active, and
hands it to a handler; every other function runs unchanged. ``hyper_parallel.experimental.
context_parallel`` keeps the mode active for its ``with`` block; the ``ContextParallel`` style
activates it around its module's forward only (pre-hook, and a forward hook that always runs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SDPA = F.scaled_dot_product_attention


class SDPAMode(TorchFunctionMode):
    def __init__(self, handler):
        super().__init__()
        self.handler = handler
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            self.calls += 1
            return self.handler(*args, **kwargs)
        return func(*args, **kwargs)


def hook_module(module, handler, what=None):
    """Make ``module``'s SDPA calls go to ``handler`` during its forward; returns the hook handles.

    With ``what`` (the style's name), a forward of ``module`` that ran no SDPA call raises: its attention
    was computed some other way (an eager softmax, a fused kernel) on this rank's sequence shard only,
    which would be silently wrong under context parallelism."""
    state = []

    def pre(mod, args, kwargs):
        mode = SDPAMode(handler)
        mode.__enter__()
        state.append(mode)

    def post(mod, args, kwargs, out):
        if state:
            mode = state.pop()
            mode.__exit__(None, None, None)
            if what is not None and mode.calls == 0 and not torch.compiler.is_compiling():
                raise RuntimeError(
                    f"{what} on {type(mod).__name__}: its forward ran no F.scaled_dot_product_attention call, so its "
                    "attention saw only this rank's sequence shard (a wrong result under context parallelism). "
                    "Compute the attention with F.scaled_dot_product_attention (Hugging Face models: "
                    "attn_implementation='sdpa'), or apply ContextParallel to the module that calls it")

    h1 = module.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = module.register_forward_hook(post, with_kwargs=True, always_call=True)
    return h1, h2


__all__ = ["SDPAMode", "hook_module"]
