"""The fast path of ops on DTensors: the cache of ready answers and the Python-level Tensor methods.

``a + b``, ``x @ w`` or ``x.view(...)`` on a DTensor normally enter through torch's C++
``__torch_function__`` machinery, which costs about 1.1-1.3 us before any of our code runs. The
methods of :data:`METHODS`, defined in the DTensor class (``dtensor.py``), let Python call our code
directly. On a hit in :data:`FAST` (the cache the op dispatcher fills, keyed exactly as its
``__torch_function__`` fast path looks it up; scalar keyword arguments included) the op runs on the
local tensors and its result is wrapped as the dispatcher's fast path does. Everything else - a miss,
non-scalar arguments, ``SkipDTensorDispatch``, disabled torch functions, an active torch function mode
- calls the original Tensor method, which goes through ``__torch_function__``. So the methods change
the cost of a call, never its result.

Why here and not in ``dispatch/``: the methods are part of the class, so the class can be complete
when its module is imported. The dispatcher (``dispatch/dispatcher.py``) fills :data:`FAST` and reads
it in its own ``__torch_function__`` fast path; it never hands the class private tables.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch

from hyper_parallel.dtensor import torch_internals
from hyper_parallel.dtensor.skip_and_replication import SKIP_ANY
from hyper_parallel.dtensor.redistribute import partial_grad_view

# (func, spec | scalar, ...) -> entry, for calls with positional DTensor/scalar arguments that need no
# redistribution, are not in place and return one tensor. An entry has ``fn`` (the local op),
# ``partial_grad_inputs`` (inputs given partial-gradient views), ``mesh``, ``out_layouts``, ``out_shapes`` and
# ``out_spec``. Filled and bounded by the dispatcher.
FAST: Dict[tuple, Any] = {}
SCALARS = (int, float, bool, type(None))
_EMPTY: dict = {}
_STRIDED = torch.strided
_make_wrapper = torch.Tensor._make_wrapper_subclass

# Methods common in model and optimizer code. Reflected operators (__radd__...) are left to
# __torch_function__: their argument order differs. A view with a tuple argument (x.view((a, b)))
# misses (tuples are not fast-key scalars) and takes the ordinary path.
METHODS = (
    "__add__", "__sub__", "__mul__", "__truediv__", "__matmul__", "__neg__", "__pow__",
    "add", "sub", "mul", "div", "matmul", "neg", "pow", "exp", "log", "sqrt", "rsqrt", "abs", "square",
    "relu", "sigmoid", "tanh", "sum", "mean", "softmax", "log_softmax", "float",
    "view", "reshape", "flatten", "unflatten", "transpose", "permute", "t", "contiguous", "unsqueeze", "squeeze",
    "expand",
)


def wrap_entry(cls: type, entry: Any, out: torch.Tensor) -> Any:
    """The DTensor of class ``cls`` around the local result ``out`` of a fast-cache ``entry``."""
    shape = entry.out_shapes
    r = _make_wrapper(cls, shape, None, None, None, out.dtype, _STRIDED, out.device)
    r._local_tensor = out
    r._mesh = entry.mesh
    r._layout = entry.out_layouts
    r._gshape = shape
    r._spec = entry.out_spec
    return r


def run_with_partial_grads(entry: Any, locs: list, kwargs: dict = _EMPTY) -> torch.Tensor:
    """Run ``entry.fn`` on local tensors, giving inputs with partial gradients (``entry.partial_grad_inputs``) their views."""
    for i, groups in entry.partial_grad_inputs:
        loc = locs[i]
        if loc.requires_grad:
            for g in groups:
                loc = partial_grad_view(loc, g)
            locs[i] = loc
    return entry.fn(*locs, **kwargs)


def fast_key(cls: type, func: Callable, args: tuple) -> Optional[tuple]:
    """The fast-cache key of ``func(*args)``, or None when an argument is neither a ``cls`` nor a scalar."""
    parts = [func]
    for a in args:
        t = type(a)
        if t is cls:
            parts.append(a._spec)
        elif t in SCALARS:
            parts.append(a)
        else:
            return None
    return tuple(parts)


def fast_key_kw(cls: type, func: Callable, args: tuple, kwargs: dict) -> Optional[tuple]:
    """The fast-cache key of a call with keyword arguments (all scalars), or None.

    The keywords form one trailing tuple; positional parts are never tuples, so the key cannot equal
    that of a call without keywords.
    """
    for v in kwargs.values():
        if type(v) not in SCALARS:
            return None
    key = fast_key(cls, func, args)
    return None if key is None else key + (tuple(kwargs.items()),)


def fast_call_kw(cls: type, func: Callable, args: tuple, kwargs: dict) -> Any:
    """The fast path for calls with scalar keyword arguments (``x.mean(-1, keepdim=True)``,
    ``F.softmax(x, dim=-1)``); returns None on a miss."""
    key = fast_key_kw(cls, func, args, kwargs)
    entry = None if key is None else FAST.get(key)
    if entry is None:
        return None
    locs = [x._local_tensor if type(x) is cls else x for x in args]
    out = entry.fn(*locs, **kwargs) if entry.partial_grad_inputs is None else run_with_partial_grads(entry, locs, kwargs)
    return wrap_entry(cls, entry, out)


def make_methods(cls: type) -> Dict[str, Callable]:
    """``{name: method}`` for each of :data:`METHODS` torch's Tensor has, for ``cls`` (the DTensor class,
    which defines them in its module).

    Each method looks up the key ``__torch_function__`` would receive for it (``a + b`` arrives as
    ``Tensor.add``), so both paths share one cache entry.
    """
    out = {}
    for name in METHODS:
        orig = getattr(torch.Tensor, name, None)
        key_func = torch_internals.torch_function_func(name) if orig is not None else None
        if key_func is not None:
            out[name] = _make(orig, key_func, name, cls)
    return out


def _make(orig, key_func, name, dtensor_cls):
    kf, DT = key_func, dtensor_cls  # the closure's short names keep the hot body readable as one screen
    fast, skip_any, scalars = FAST, SKIP_ANY, SCALARS
    tf_enabled, tf_mode_enabled = torch_internals.torch_function_enabled, torch_internals.torch_function_mode_enabled
    run_pg, call_kw, wrap = run_with_partial_grads, fast_call_kw, wrap_entry

    def method(self, *args, **kwargs):
        if skip_any[0] or type(self) is not DT or not tf_enabled() or tf_mode_enabled():
            return orig(self, *args, **kwargs)
        if kwargs:
            out = call_kw(DT, kf, (self,) + args, kwargs)
            return orig(self, *args, **kwargs) if out is None else out
        n = len(args)
        if n == 0:
            entry = fast.get((kf, self._spec))
            if entry is not None and entry.partial_grad_inputs is None:
                return wrap(DT, entry, entry.fn(self._local_tensor))
        elif n == 1:
            b = args[0]
            tb = type(b)
            key = (kf, self._spec, b._spec) if tb is DT else (kf, self._spec, b) if tb in scalars else None
            entry = None if key is None else fast.get(key)
            if entry is not None:
                sl = self._local_tensor
                lb = b._local_tensor if tb is DT else b
                # partial-gradient views matter only for inputs that require grad
                if entry.partial_grad_inputs is None or not (sl.requires_grad or (tb is DT and lb.requires_grad)):
                    return wrap(DT, entry, entry.fn(sl, lb))
                return wrap(DT, entry, run_pg(entry, [sl, lb]))
        elif n == 2 and type(args[0]) in scalars and type(args[1]) in scalars:  # transpose(1, 2), view(a, b)
            entry = fast.get((kf, self._spec) + args)
            if entry is not None and entry.partial_grad_inputs is None:
                return wrap(DT, entry, entry.fn(self._local_tensor, *args))
        else:
            key = fast_key(DT, kf, (self,) + args)
            entry = None if key is None else fast.get(key)
            if entry is not None and entry.partial_grad_inputs is None:
                return wrap(DT, entry, entry.fn(self._local_tensor, *[b._local_tensor if type(b) is DT else b
                                                                  for b in args]))
        # a miss, or partial-gradient views to apply: the ordinary path (its fast path handles the latter)
        return orig(self, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"DTensor.{name}"
    method.__doc__ = getattr(orig, "__doc__", None)
    return method


__all__ = ["FAST", "SCALARS", "METHODS", "wrap_entry", "run_with_partial_grads", "fast_key", "fast_key_kw",
           "fast_call_kw", "make_methods"]
