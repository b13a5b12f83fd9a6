"""Python-level fast paths for the most common Tensor methods on DTensors.

``a + b``, ``x @ w`` or ``x.view(...)`` on a DTensor normally enter through the
framework's C++ ``__torch_function__`` machinery, which costs about 1.1-1.3 us
before any of our code runs. Defining these methods on the DTensor class lets
Python call our code directly. On a hit in the dispatcher's fast cache (the
same entries, keyed by the same Tensor method, that ``__torch_function__``
uses) the op runs on the local tensors and its result is wrapped exactly as the
``__torch_function__`` fast path does. Everything else - a cache miss, keyword
arguments, non-scalar arguments, SkipDTensorDispatch, disabled torch functions
or an active torch function mode - calls the original method, which goes
through ``__torch_function__`` as before. So the methods change the cost of a
call, never its result.
"""
from __future__ import annotations

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


def install(cls, fast, skip_any, scalars, key_of, wrap, run_pg, call_kw, tf_enabled, tf_mode_enabled, base,
            probe_func):
    """Define each of :data:`METHODS` on ``cls`` (the DTensor class).

    ``fast``: the dispatcher's fast cache; ``skip_any``: the SkipDTensorDispatch
    counter; ``scalars``: argument types that may appear in fast keys;
    ``key_of(func, args)``: the fast key of a call with any number of arguments;
    ``wrap(entry, local)``: wraps a local result for a fast entry;
    ``run_pg(entry, locals)``: runs ``entry.fn`` on locals given partial-gradient views;
    ``call_kw(func, args, kwargs)``: the fast path of a keyword call (None on a miss);
    ``tf_enabled`` / ``tf_mode_enabled``: the framework's torch-function state
    checks; ``base``: the framework tensor class holding the original methods;
    ``probe_func(name)``: the function object ``__torch_function__`` receives
    for method ``name`` (``a + b`` arrives as ``Tensor.add``), which keys the cache.
    """
    for name in METHODS:
        orig = getattr(base, name, None)
        key_func = probe_func(name) if orig is not None else None
        if key_func is not None:
            setattr(cls, name, _make(orig, key_func, name, cls, fast, skip_any, scalars, key_of, wrap, run_pg,
                                     call_kw, tf_enabled, tf_mode_enabled))


def _make(orig, kf, name, DT, fast, skip_any, scalars, key_of, wrap, run_pg, call_kw, tf_enabled,
          tf_mode_enabled):
    def method(self, *args, **kwargs):
        if kwargs:
            if not skip_any[0] and type(self) is DT and tf_enabled() and not tf_mode_enabled():
                out = call_kw(kf, (self,) + args, kwargs)
                if out is not None:
                    return out
        elif not skip_any[0] and type(self) is DT and tf_enabled() and not tf_mode_enabled():
            n = len(args)
            key = None
            if n == 0:
                key = (kf, self._spec)
            elif n == 1:
                b = args[0]
                tb = type(b)
                if tb is DT:
                    key = (kf, self._spec, b._spec)
                elif tb in scalars:
                    key = (kf, self._spec, b)
            elif n == 2 and type(args[0]) in scalars and type(args[1]) in scalars:  # transpose(1, 2)...
                key = (kf, self._spec) + args
                n = -2  # two scalar arguments
            else:
                key = key_of(kf, (self,) + args)
            if key is not None:
                entry = fast.get(key)
                if entry is not None:
                    sl = self._local_tensor
                    if n == 0:
                        if entry.pg_args is None:
                            return wrap(entry, entry.fn(sl))
                    elif n == 1:
                        lb = b._local_tensor if tb is DT else b
                        # partial-gradient views matter only for inputs that require grad
                        if entry.pg_args is None or not (sl.requires_grad or (tb is DT and lb.requires_grad)):
                            return wrap(entry, entry.fn(sl, lb))
                        return wrap(entry, run_pg(entry, [sl, lb]))
                    elif n == -2:
                        if entry.pg_args is None:
                            return wrap(entry, entry.fn(sl, *args))
                    locs = [sl] + [b._local_tensor if type(b) is DT else b for b in args]
                    if entry.pg_args is None:
                        return wrap(entry, entry.fn(*locs))
                    return wrap(entry, run_pg(entry, locs))
        return orig(self, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"DTensor.{name}"
    method.__doc__ = getattr(orig, "__doc__", None)
    return method
