"""Context-parallel SDPA as one opaque op for ``torch.compile`` (``torch.library.custom_op``).

Dynamo cannot trace the planning (it reads the ``DeviceMesh``) nor the ring's point-to-point sends, so
while compiling, an intercepted ``F.scaled_dot_product_attention`` call becomes one call of
``hyper_parallel_cp::sdpa(q, k, v, handler_id, is_causal, scale, enable_gqa)``: the graph holds a single
node, no graph break. ``handler_id`` (an int) names the eager handler registered when the
``ContextParallel`` style was applied (mesh, method, load balance); the op runs it eagerly at run time.

Backward is the registered autograd formula, a second op ``hyper_parallel_cp::sdpa_backward``: it
runs the eager handler again with autograd on and takes ``torch.autograd.grad`` of it (the forward
attention is recomputed once in backward; exact, same collectives as eager, plus the forward's).
The fake (meta) implementations give the shapes: ``out`` is ``q.shape[:-1] + (v.shape[-1],)``.
Under compile the ``attention_mask(...)`` context is not supported (the op would not see it in
backward); the op raises if one is active.
"""
from __future__ import annotations

from typing import Optional

import torch

_HANDLERS: dict = {}
# how often the ops ran (tests check that compiled blocks went through them)
CALLS = {"forward": 0, "backward": 0}


def register_handler(handler) -> int:
    """Keep ``handler`` (the eager SDPA handler of one ``ContextParallel`` application); returns its id."""
    hid = len(_HANDLERS)
    _HANDLERS[hid] = handler
    return hid


def _autograd_on():
    """Re-enable autograd dispatch inside a custom op's implementation (which runs below Autograd)."""
    ex = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"):
        k = getattr(torch._C.DispatchKey, name, None)
        if k is not None:
            ex = ex.remove(k)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), ex)


def _call(hid, q, k, v, is_causal, scale, enable_gqa):
    return _HANDLERS[hid](q, k, v, None, 0.0, is_causal, scale, enable_gqa, compiled=True)


@torch.library.custom_op("hyper_parallel_cp::sdpa", mutates_args=())
def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hid: int, is_causal: bool, scale: Optional[float],
         enable_gqa: bool) -> torch.Tensor:
    CALLS["forward"] += 1
    with torch.no_grad():
        out = _call(hid, q, k, v, is_causal, scale, enable_gqa)
    return out.clone() if out is q or out is k or out is v else out


@sdpa.register_fake
def _sdpa_fake(q, k, v, hid, is_causal, scale, enable_gqa):
    return q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))


@torch.library.custom_op("hyper_parallel_cp::sdpa_backward", mutates_args=())
def sdpa_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hid: int, is_causal: bool,
                  scale: Optional[float], enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    CALLS["backward"] += 1
    with torch.enable_grad(), _autograd_on():
        q2, k2, v2 = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = _call(hid, q2, k2, v2, is_causal, scale, enable_gqa)
        dq, dk, dv = torch.autograd.grad(out, (q2, k2, v2), dout, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g.clone(memory_format=torch.contiguous_format)
                 for g, t in ((dq, q), (dk, k), (dv, v)))


@sdpa_backward.register_fake
def _sdpa_backward_fake(dout, q, k, v, hid, is_causal, scale, enable_gqa):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, hid, is_causal, scale, enable_gqa = inputs
    ctx.save_for_backward(q, k, v)
    ctx.args = (hid, is_causal, scale, enable_gqa)


def _backward(ctx, dout):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = sdpa_backward(dout.contiguous(), q, k, v, *ctx.args)
    return dq, dk, dv, None, None, None, None


sdpa.register_autograd(_backward, setup_context=_setup)


def is_compiling() -> bool:
    return bool(torch.compiler.is_compiling())


__all__ = ["register_handler", "sdpa", "sdpa_backward", "is_compiling"]
