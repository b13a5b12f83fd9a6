"""Random ops on DTensors: the framework's own draws on whole tensors, layout-independent draws on shards.

Two regimes, chosen from the input layouts when the dispatcher builds the op:

* **Whole on every rank** (every DTensor input is ``Replicate`` on every mesh
  dim of size > 1 and no input is ``Partial``): the op runs unchanged on the
  local tensors with the framework's generator (``torch.manual_seed``, or the
  op's ``generator=``), so the result is exactly what one process gets from the
  same call after the same seed. Every rank runs the same draw on the same data
  with the same generator state, so the replicas agree and the generators stay
  in step (SPMD: every rank must have seeded alike, e.g. ``torch.manual_seed(s)``
  on every rank). The op also takes its place in the DTensor stream
  (:func:`~hyper_parallel.dtensor.random.consume_key`), so later draws on
  shards do not depend on which earlier ops ran whole.
* **Sharded or Partial input**: the layout-independent DTensor stream
  (``hyper_parallel.manual_seed``), identical for every mesh and sharding.

:func:`torch_draws` is the first regime for any rule; the rules below are the
random ops that had none (``bernoulli``, ``bernoulli_``, ``exponential_``,
``geometric_``, ``log_normal_``, ``cauchy_``, ``randint_like``); ``dropout``,
``multinomial``, ``rand_like``, ``randn_like``, ``normal_`` and ``uniform_``
call :func:`torch_draws` from their own rules. On shards these draw ``u`` (or
``z`` for ``log_normal_``) from the stream in float64 and transform it:
``bernoulli``: ``u < p``; ``exponential_``: ``-log1p(-u) / lambd``;
``geometric_``: ``max(1, ceil(log1p(-u) / log1p(-p)))``; ``log_normal_``:
``exp(mean + std * z)``; ``cauchy_``: ``median + sigma * tan(pi * (u - 1/2))``;
``randint_like``: ``low + floor(u * (high - low))``.
"""
from __future__ import annotations

import math

from hyper_parallel.dtensor import random as dt_random
from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, reduce_all_partial
from hyper_parallel.dispatch.rules.base import _invalidate as _clear_dispatch_caches
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt, bind_args as _bind
import torch


dt_random.on_scheme_change(_clear_dispatch_caches)   # cached strategies below depend on the RNG scheme


def is_whole(layout) -> bool:
    """Every rank holds the whole tensor: no Partial, shards only over mesh dims of size 1."""
    if layout.has_partial():
        return False
    ms = layout.mesh_shape
    return all(ms[d] == 1 for d in layout.sharded_mesh_dims())


def torch_draws(call, out_layout=None, out_shapes=None):
    """The op itself on the local tensors (the framework's generator) when all DTensor inputs are whole, or
    on every local shard where torch's DTensor RNG scheme does so (``dt_random.draws_locally``), else None."""
    if not call.layouts:
        return None
    if not all(is_whole(l) for l in call.layouts) and \
            not dt_random.draws_locally(getattr(call.mesh, "device_type", "cpu"), call.layouts):
        return None
    func = call.func

    def local_fn(*args, **kwargs):
        dt_random.consume_key()
        return func(*args, **kwargs)
    out = call.layouts[0] if out_layout is None else out_layout
    return Strategy(call.layouts, out, local_fn=local_fn, out_shapes=out_shapes)


def _first_dt(call, what):
    if not call.args or not _is_dt(call.args[0]):
        raise NotImplementedError(f"{call.name}: the {what} must be a DTensor")


def _no_generator(call, kwargs):
    if kwargs.get("generator") is not None:
        raise NotImplementedError(
            f"{call.name} on a sharded DTensor: generator= is not supported (the draws come from the "
            "layout-independent DTensor random stream; seed it with hyper_parallel.manual_seed). A generator "
            "is used when every rank holds the whole tensor (Replicate placements)")


class BernoulliRule(DistributedOp):
    """torch.bernoulli(input) (probabilities in ``input``) and bernoulli(input, p) (a float p)."""

    float_args_matter = False

    def strategy(self, call):
        _first_dt(call, "input")
        shape = torch.Size(call.shapes[0])
        st = torch_draws(call, out_layout=call.layouts[0], out_shapes=shape)
        if st is not None:
            return st
        _no_generator(call, call.kwargs)
        if len(call.layouts) != 1:
            raise NotImplementedError(f"{call.name}: only the input may be a DTensor (p must be a float)")
        tgt = reduce_all_partial(call.layouts[0])
        lshape, off = tgt.local_shape_and_offset(tuple(shape), coord=call.mesh.get_coordinate())
        ops = torch

        def local_fn(local, *args, **kwargs):
            v = _bind((local,) + args, kwargs, ("input", "p"))
            u = dt_random.random_local("rand", tuple(shape), lshape, off, ops.float64, local.device)
            p = v.get("p")
            prob = local.detach().double() if p is None else p
            out = (u < prob).to(local.dtype)
            o = kwargs.get("out")
            return o.copy_(out) if o is not None else out
        return Strategy([tgt], tgt, local_fn=local_fn, out_shapes=shape)


def _inplace_draw(call):
    """Common start of the in-place draw rules: torch's own draw when the tensor is replicated
    (returned as ``(strategy, None)``), else ``(None, (shape, layout, local shape, offset))``
    for the layout-independent stream."""
    _first_dt(call, "tensor")
    shape = torch.Size(call.shapes[0])
    lay = call.layouts[0]
    st = torch_draws(call, out_layout=lay, out_shapes=shape)
    if st is not None:
        return st, None
    _no_generator(call, call.kwargs)
    if lay.has_partial():
        raise RuntimeError(f"{call.name} on a Partial DTensor is ambiguous; call reduce_partial() first")
    lshape, off = lay.local_shape_and_offset(tuple(shape), coord=call.mesh.get_coordinate())
    return None, (shape, lay, lshape, off)


class BernoulliInplaceRule(DistributedOp):
    """x.bernoulli_(p): p a float or a DTensor of x's shape (laid out like x)."""

    float_args_matter = False

    def strategy(self, call):
        st, stream = _inplace_draw(call)
        if st is not None:
            return st
        shape, lay, lshape, off = stream
        targets = [lay]
        if len(call.layouts) > 1:
            if len(call.layouts) != 2 or tuple(call.shapes[1]) != tuple(shape):
                raise NotImplementedError(f"{call.name}: p must be a float or a DTensor of the same shape "
                                          f"{tuple(shape)}, got shape {tuple(call.shapes[1])}")
            targets.append(lay)
        ops = torch

        def local_fn(local, *args, **kwargs):
            v = _bind((local,) + args, kwargs, ("self", "p"))
            p = v.get("p", 0.5)
            u = dt_random.random_local("rand", tuple(shape), lshape, off, ops.float64, local.device)
            prob = p.detach().double() if isinstance(p, torch.Tensor) else p
            return local.copy_((u < prob).to(local.dtype))
        return Strategy(targets, lay, local_fn=local_fn, out_shapes=shape)


def _exponential(uniform, lambd=1.0):
    return -(-uniform).log1p() / lambd


def _geometric(uniform, p):
    return (((-uniform).log1p()) / math.log1p(-p)).ceil().clamp_min(1)


def _cauchy(uniform, median=0.0, sigma=1.0):
    return median + sigma * (math.pi * (uniform - 0.5)).tan()


def _log_normal(normal, mean=1.0, std=2.0):
    return (mean + std * normal).exp()


_INPLACE = {  # name: (argument names after self, kind, transform)
    "exponential_": (("lambd",), "rand", _exponential),
    "geometric_": (("p",), "rand", _geometric),
    "cauchy_": (("median", "sigma"), "rand", _cauchy),
    "log_normal_": (("mean", "std"), "randn", _log_normal),
}


class InplaceDistributionRule(DistributedOp):
    """exponential_ / geometric_ / cauchy_ / log_normal_: a transform of the stream's uniform (normal) draws."""

    float_args_matter = False

    def strategy(self, call):
        st, stream = _inplace_draw(call)
        if st is not None:
            return st
        shape, lay, lshape, off = stream
        names, kind, transform = _INPLACE[call.name]
        ops = torch

        def local_fn(local, *args, **kwargs):
            v = _bind(args, {k: x for k, x in kwargs.items() if k != "generator"}, names)
            draws = dt_random.random_local(kind, tuple(shape), lshape, off, ops.float64, local.device)
            return local.copy_(transform(draws, **v).to(local.dtype))
        return Strategy([lay], lay, local_fn=local_fn, out_shapes=shape)


class RandintLikeRule(DistributedOp):
    """torch.randint_like(input, high) / (input, low, high): laid out like the input (Partial reduced)."""

    float_args_matter = False

    def strategy(self, call):
        _first_dt(call, "input")
        shape = torch.Size(call.shapes[0])
        lay = call.layouts[0]
        st = torch_draws(call, out_layout=lay.without_partial(), out_shapes=shape)
        if st is not None:
            return st
        _no_generator(call, call.kwargs)
        if len(call.layouts) != 1:
            raise NotImplementedError(f"{call.name}: low and high must be ints")
        out = lay.without_partial()
        lshape, off = out.local_shape_and_offset(tuple(shape), coord=call.mesh.get_coordinate())
        ops = torch

        def local_fn(local, *args, **kwargs):
            if len(args) == 1:
                low, high = kwargs.get("low", 0), args[0]
            elif len(args) >= 2:
                low, high = args[0], args[1]
            else:
                low, high = kwargs.get("low", 0), kwargs["high"]
            if not high > low:
                raise RuntimeError(f"randint_like: expected low < high, got low={low}, high={high}")
            u = dt_random.random_local("rand", tuple(shape), lshape, off, ops.float64,
                                       kwargs.get("device") or local.device)
            vals = (low + (u * (high - low)).floor()).clamp_max(high - 1)
            t = vals.to(kwargs.get("dtype") or local.dtype)
            if kwargs.get("requires_grad"):
                t.requires_grad_()
            return t
        return Strategy([lay], out, local_fn=local_fn, out_shapes=shape)


def register_all():
    BernoulliRule("bernoulli")
    BernoulliInplaceRule("bernoulli_")
    for n in _INPLACE:
        InplaceDistributionRule(n)
    RandintLikeRule("randint_like")


__all__ = ["register_all", "is_whole", "torch_draws", "BernoulliRule", "BernoulliInplaceRule",
           "InplaceDistributionRule", "RandintLikeRule"]
