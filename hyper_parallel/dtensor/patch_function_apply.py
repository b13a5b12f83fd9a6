"""Let ``torch.autograd.Function.apply`` hand calls with DTensor arguments to hyper_parallel.

A user's ``torch.autograd.Function`` written for ``torch.distributed.tensor`` gets
DTensors in ``forward`` and DTensor gradients in ``backward``. hyper_parallel's
DTensor keeps autograd state on its local tensor, so the C++ ``Function.apply``
would see inputs that do not require grad. ``install(types, handler)`` wraps
``Function.apply`` once: a call whose positional arguments include an instance of
``types`` goes to ``handler(cls, args, kwargs)`` (the core's bridge); every other
call - including hyper_parallel's own functions, which run on local tensors - takes
the original path after one ``isinstance`` scan of the arguments.
"""
from __future__ import annotations

import torch

_STATE = {"types": None, "handler": None, "orig": None}


def install(types, handler) -> None:
    """Route ``Function.apply`` calls with arguments of ``types`` to ``handler`` (idempotent)."""
    _STATE["types"], _STATE["handler"] = tuple(types), handler
    if _STATE["orig"] is not None:
        return
    orig = torch.autograd.Function.__dict__["apply"].__func__
    _STATE["orig"] = orig

    def apply(cls, *args, **kwargs):
        types = _STATE["types"]
        for a in args:
            if isinstance(a, types):
                return _STATE["handler"](cls, args, kwargs)
        return orig(cls, *args, **kwargs)

    apply.__doc__ = orig.__doc__
    apply.__wrapped__ = orig
    torch.autograd.Function.apply = classmethod(apply)


def original_apply(cls, *args, **kwargs):
    """The framework's own ``Function.apply`` (for the bridge's inner autograd node)."""
    orig = _STATE["orig"] or torch.autograd.Function.__dict__["apply"].__func__
    return orig(cls, *args, **kwargs)


def uses_setup_context(cls) -> bool:
    """Whether ``cls`` splits forward and ``setup_context`` (forward then takes no ctx)."""
    from torch.autograd.function import _is_setup_context_defined
    return _is_setup_context_defined(cls.setup_context)
