"""Argument walking for the op dispatcher: cache-key signatures, finding and replacing DTensors,
plain tensors mixed with DTensors (see docs/design.md, "The op path")."""
from __future__ import annotations

import warnings

from hyper_parallel.dtensor.mesh_semantics import semantics_of
from hyper_parallel.dtensor.skip_and_replication import IMPLICIT_REPLICATION as _IMPLICIT
from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.dtensor.placement_types import Replicate
from hyper_parallel.dispatch.rules import base as _base
from hyper_parallel.dtensor import torch_internals
import torch

_Tensor = torch.Tensor
_LEAF_TYPES = (type(None), bool, int, float, str, complex, type(Ellipsis)) + tuple((lambda: torch_internals.HASHABLE_LEAF_TYPES)())
_INDEX_OPS = frozenset({"__getitem__", "__setitem__", "index_select", "gather", "index", "take_along_dim"})
_BOOL = torch.bool


_OP_NAMES: dict = {}


def _op_name(func):
    n = _OP_NAMES.get(func)
    if n is None:
        n = _OP_NAMES[func] = torch_internals.op_name(func)
    return n


def _signature(arg):
    """Hashable signature of a non-DTensor argument (part of the cache key)."""
    if isinstance(arg, _LEAF_TYPES):
        return arg
    if isinstance(arg, DTensor):
        return (arg._layout, arg._gshape)
    if isinstance(arg, _Tensor):
        return ("T", tuple(arg.shape), arg.dtype, arg.requires_grad)
    if isinstance(arg, (list, tuple)):
        return (type(arg).__name__,) + tuple(_signature(x) for x in arg)
    if isinstance(arg, slice):
        return ("slice", _signature(arg.start), _signature(arg.stop), _signature(arg.step))
    if isinstance(arg, dict):
        return ("dict",) + tuple((k, _signature(v)) for k, v in arg.items())
    try:
        hash(arg)
        return arg
    except TypeError:
        return ("id", id(arg))


def _signature_without_floats(arg):
    """:func:`_signature` with float values replaced by their type (for rules whose answer ignores them)."""
    t = type(arg)
    if t is float:
        return float
    if t is list or t is tuple:
        return (t.__name__,) + tuple(_signature_without_floats(x) for x in arg)
    if t is dict:
        return ("dict",) + tuple((k, _signature_without_floats(v)) for k, v in arg.items())
    return _signature(arg)


def _inplace_target(args, kwargs, dts):
    """The DTensor an in-place op modifies: ``out=``, else ``self`` (first positional or keyword tensor)."""
    out = kwargs.get("out")
    if isinstance(out, DTensor):
        return out
    if args and isinstance(args[0], DTensor):
        return args[0]
    for k in ("self", "input", "tensor"):
        v = kwargs.get(k)
        if isinstance(v, DTensor):
            return v
    return dts[0] if dts else None


def _collect(args, out):
    """Append DTensors found in ``args`` (one level of list/tuple nesting and deeper) to ``out``."""
    for a in args:
        if isinstance(a, DTensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            _collect(a, out)


def _replace(args, replacements):
    """Rebuild ``args`` with DTensors replaced by successive items of ``replacements``."""
    res = []
    for a in args:
        if isinstance(a, DTensor):
            res.append(next(replacements))
        elif isinstance(a, (list, tuple)) and any(isinstance(x, (DTensor, list, tuple)) for x in a):
            res.append(type(a)(_replace(a, replacements)) if type(a) in (list, tuple) else _replace(a, replacements))
        else:
            res.append(a)
    return res


def _check_plain_tensors(func, args, kwargs, mesh):
    """Plain tensors mixed with DTensors: 0-d ones broadcast; others need implicit replication.

    A 0-d tensor that requires grad is taken as replicated too (not passed through
    as a number): its gradient may be partial over the mesh and must be summed.
    """
    index_op = _op_name(func) in _INDEX_OPS

    one_elem = []
    scalar_grad = []

    def bad(arg):
        if not isinstance(arg, _Tensor) or isinstance(arg, DTensor):
            return False
        if arg.dim() == 0:
            if arg.requires_grad:
                scalar_grad.append(arg)
            return False
        if arg.numel() == 1:  # as PyTorch: a one-element tensor is taken as replicated
            one_elem.append(arg)
            return False
        # integer index tensors of indexing ops are naturally replicated (bool masks are not:
        # the output shape depends on their values, which the cache key does not hold)
        return not (index_op and arg.dtype != _BOOL and not arg.is_floating_point() and not arg.is_complex())

    def walk(items):
        for a in items:
            if bad(a):
                return a
            if isinstance(a, (list, tuple)):
                r = walk(a)
                if r is not None:
                    return r
        return None
    offender = walk(args)
    if offender is None:
        offender = walk(kwargs.values())
    if offender is None and not one_elem and not scalar_grad:
        return args, kwargs
    if offender is None and one_elem:
        warnings.warn(f"{torch_internals.op_name(func)}: found a non-scalar tensor with numel=1 and ndim!=0 (shape "
                      f"{tuple(one_elem[0].shape)}) mixed with DTensors; it is taken as replicated. Consider a "
                      "scalar (0-d) tensor or an explicit DTensor instead", UserWarning, stacklevel=4)
    elif offender is not None and not _IMPLICIT[0] and \
            _op_name(func) not in _base.PLAIN_AS_REPLICATED and not semantics_of(mesh).plain_tensors_replicated:
        # (HyperParallel's meshes take plain tensors as replicated, as HyperParallel does)
        # RuntimeError, not TypeError: Python turns a TypeError from an operator into "unsupported operand"
        raise RuntimeError(
            f"{torch_internals.op_name(func)}: got a plain tensor of shape {tuple(offender.shape)} mixed with DTensors; "
            "convert it with distribute_tensor()/DTensor.from_local(), or wrap the code in "
            "`with hyper_parallel.implicit_replication():` to treat plain tensors as replicated")
    def conv(arg):
        if isinstance(arg, _Tensor) and not isinstance(arg, DTensor) and (arg.dim() > 0 or arg.requires_grad):
            return DTensor.from_local(arg, mesh, [Replicate()] * mesh.ndim)
        if isinstance(arg, (list, tuple)):
            return type(arg)(conv(x) for x in arg) if type(arg) in (list, tuple) else arg
        return arg
    return [conv(a) for a in args], {k: conv(v) for k, v in kwargs.items()}
