"""Python-level fast paths for the most common Tensor methods on DTensors.

``a + b``, ``x @ w`` or ``x.view(...)`` on a DTensor normally enter through the
framework's C++ ``__torch_function__`` machinery, which costs about 1.1-1.3 us
before any of our code runs. Defining these methods on the DTensor class lets
Python call our code directly. On a hit in the dispatcher's fast cache (the
same entries, keyed by the same Tensor method, that ``__torch_function__``
uses; scalar keyword arguments included) the op runs on the local tensors and
its result is wrapped exactly as the ``__torch_function__`` fast path does.
Everything else - a cache miss, non-scalar arguments, SkipDTensorDispatch,
disabled torch functions or an active torch function mode - calls the original
method, which goes through ``__torch_function__`` as before. So the methods
change the cost of a call, never its result.
"""
from __future__ import annotations
import torch

from hyper_parallel.dtensor import torch_internals

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


def make_methods(cls, dispatch) -> dict:
    """``{name: method}`` for each of :data:`METHODS` the framework's Tensor has, for ``cls`` (the
    DTensor class); ``dtensor.set_dispatcher`` defines them on the class (eager mode).

    ``dispatch``: the dispatcher module (``dispatch/dispatcher.py``), whose fast cache
    (``_FAST``) and fast-path helpers the methods share
    (original methods, torch-function state checks, and the function object
    ``__torch_function__`` receives for each method, which keys the cache:
    ``a + b`` arrives as ``Tensor.add``).
    """
    out = {}
    for name in METHODS:
        orig = getattr(torch.Tensor, name, None)
        key_func = torch_internals.torch_function_func(name) if orig is not None else None
        if key_func is not None:
            out[name] = _make(orig, key_func, name, cls, dispatch)
    return out


def _make(orig, kf, name, DT, dispatch):
    fast, skip_any, scalars = dispatch._FAST, dispatch._SKIP_ANY, dispatch._SCALARS
    key_of, wrap, run_pg, call_kw = dispatch._fast_key, dispatch._wrap_entry, dispatch._run_pg, dispatch._fast_call_kw
    tf_enabled, tf_mode_enabled = torch_internals.torch_function_enabled, torch_internals.torch_function_mode_enabled

    def method(self, *args, **kwargs):
        if skip_any[0] or type(self) is not DT or not tf_enabled() or tf_mode_enabled():
            return orig(self, *args, **kwargs)
        if kwargs:
            out = call_kw(kf, (self,) + args, kwargs)
            return orig(self, *args, **kwargs) if out is None else out
        n = len(args)
        if n == 0:
            entry = fast.get((kf, self._spec))
            if entry is not None and entry.pg_args is None:
                return wrap(entry, entry.fn(self._local_tensor))
        elif n == 1:
            b = args[0]
            tb = type(b)
            key = (kf, self._spec, b._spec) if tb is DT else (kf, self._spec, b) if tb in scalars else None
            entry = None if key is None else fast.get(key)
            if entry is not None:
                sl = self._local_tensor
                lb = b._local_tensor if tb is DT else b
                # partial-gradient views matter only for inputs that require grad
                if entry.pg_args is None or not (sl.requires_grad or (tb is DT and lb.requires_grad)):
                    return wrap(entry, entry.fn(sl, lb))
                return wrap(entry, run_pg(entry, [sl, lb]))
        elif n == 2 and type(args[0]) in scalars and type(args[1]) in scalars:  # transpose(1, 2), view(a, b)
            entry = fast.get((kf, self._spec) + args)
            if entry is not None and entry.pg_args is None:
                return wrap(entry, entry.fn(self._local_tensor, *args))
        else:
            key = key_of(kf, (self,) + args)
            entry = None if key is None else fast.get(key)
            if entry is not None and entry.pg_args is None:
                return wrap(entry, entry.fn(self._local_tensor, *[b._local_tensor if type(b) is DT else b
                                                                  for b in args]))
        # a miss, or partial-gradient views to apply: the ordinary path (its fast path handles the latter)
        return orig(self, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"DTensor.{name}"
    method.__doc__ = getattr(orig, "__doc__", None)
    return method
