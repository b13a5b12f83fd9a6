"""Routing ``F.scaled_dot_product_attention`` calls to context-parallel attention.

A ``TorchFunctionMode`` sees every call of ``torch.nn.functional.scaled_dot_product_attention``
(``torch._C._nn.scaled_dot_product_attention``, however it is reached) while it is active, and
hands it to a handler; every other function runs unchanged. ``hyper_parallel.experimental.
context_parallel`` keeps the mode active for its ``with`` block; the ``ContextParallel`` style
activates it around its module's forward only (pre-hook, and a forward hook that always runs).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SDPA = F.scaled_dot_product_attention


class SDPAMode(TorchFunctionMode):
    def __init__(self, handler):
        super().__init__()
        self.handler = handler

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.handler(*args, **kwargs)
        return func(*args, **kwargs)


def hook_module(module, handler):
    """Make ``module``'s SDPA calls go to ``handler`` during its forward; returns the hook handles."""
    state = []

    def pre(mod, args, kwargs):
        mode = SDPAMode(handler)
        mode.__enter__()
        state.append(mode)

    def post(mod, args, kwargs, out):
        if state:
            state.pop().__exit__(None, None, None)

    h1 = module.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = module.register_forward_hook(post, with_kwargs=True, always_call=True)
    return h1, h2


__all__ = ["SDPAMode", "hook_module"]
