"""User ``autograd.Function`` subclasses called with DTensors, as in ``torch.distributed.tensor``.

PyTorch runs such a function with DTensors in ``forward`` and DTensor gradients in
``backward``. Here the DTensor's autograd state lives on its local tensor, so the
call is bridged: one inner autograd node (:class:`_Bridge`) takes the local
tensors, re-wraps them as DTensors for the user's ``forward`` (grad disabled, as
always inside ``forward``), and returns the outputs' local tensors; its backward
wraps the incoming local gradients as DTensors (gradient layout of each output;
``None`` stays ``None`` when the user turned off ``ctx.set_materialize_grads``),
calls the user's ``backward`` and hands each DTensor gradient back laid out as its
input's gradient. The user's ``ctx`` is the inner node's ctx, so
``save_for_backward``, ``needs_input_grad`` and ``set_materialize_grads`` work.
``patch_function_apply.py`` routes the calls here.
"""
from __future__ import annotations

import threading

from hyper_parallel.dtensor.dtensor import DTensor, _grad_layout
import torch
from hyper_parallel.dtensor import patch_function_apply

_hook = patch_function_apply
_JOBS = threading.local()


def _meta(value):
    return (value._mesh, value._layout, value._gshape) if isinstance(value, DTensor) else None


class _Bridge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *flat):
        job = _JOBS.stack[-1]
        user, metas, kwargs = job["cls"], job["metas"], job["kwargs"]
        args = tuple(DTensor._wrap(v, *m) if m is not None else v for v, m in zip(flat, metas))
        if _hook.uses_setup_context(user):
            out = user.forward(*args, **kwargs)
            user.setup_context(ctx, args, out)
        else:
            out = user.forward(ctx, *args, **kwargs)
        single = not isinstance(out, tuple)
        outs = (out,) if single else out
        ctx._hp_user, ctx._hp_in, ctx._hp_out = user, metas, [_meta(o) for o in outs]
        job["out_meta"], job["single"] = ctx._hp_out, single
        locs = tuple(o._local_tensor if isinstance(o, DTensor) else o for o in outs)
        return locs[0] if single else locs

    @staticmethod
    def backward(ctx, *grads):
        dgrads = [DTensor._wrap(g, m[0], _grad_layout(m[1]), m[2]) if g is not None and m is not None else g
                  for g, m in zip(grads, ctx._hp_out)]
        if getattr(ctx._hp_user, "boxed_grads_call", False):  # AOTAutograd's compiled function (torch.compile)
            res = ctx._hp_user.backward(ctx, list(dgrads))
        else:
            res = ctx._hp_user.backward(ctx, *dgrads)
        res = res if isinstance(res, tuple) else (res,)
        out = []
        for r, m in zip(res, ctx._hp_in):
            if isinstance(r, DTensor):
                if m is not None:
                    want = _grad_layout(m[1])
                    if r._layout != want:
                        r = r.redistribute(m[0], want)
                r = r._local_tensor
            out.append(r)
        return tuple(out)


def _apply_on_dtensors(cls, args, kwargs):
    """``cls.apply(*args, **kwargs)`` with DTensor arguments (see module docstring)."""
    stack = getattr(_JOBS, "stack", None)
    if stack is None:
        stack = _JOBS.stack = []
    job = {"cls": cls, "metas": [_meta(a) for a in args], "kwargs": kwargs}
    stack.append(job)
    try:
        out = _hook.original_apply(_Bridge, *[a._local_tensor if isinstance(a, DTensor) else a for a in args])
    finally:
        stack.pop()
    outs = (out,) if job["single"] else out
    wrapped = tuple(DTensor._wrap(o, *m) if m is not None else o for o, m in zip(outs, job["out_meta"]))
    return wrapped[0] if job["single"] else wrapped


_hook.install((DTensor,), _apply_on_dtensors)
