"""Ops of HyperParallel's operator list not covered by the other families.

* ``pad``: the padded (trailing) dims are unsharded, the others keep their
  shards; Partial passes through a zero constant pad (linear), else it is reduced.
* ``repeat_interleave``: the repeated dim is unsharded (``dim=None`` flattens:
  everything replicated); a tensor of repeats is replicated (plain or DTensor), and
  with one, dims whose shards are uneven are unsharded as well (the data-dependent
  output shape is derived from the local result).
* ``outer`` / ``ger``: the first operand's shard goes to output dim 0, the
  second's to dim 1 (unsharded if it uses the same mesh dim).
* ``one_hot``: shards kept, the new class dim unsharded; with
  ``num_classes=-1`` (read from the data) the input is replicated.
* ``histc``: with an explicit range, each rank counts its own shard and the
  result is ``Partial(sum)`` (nothing moves until it is read); with the
  data-dependent default range the input is replicated.
* ``nonzero`` / ``argwhere``: data-dependent shape: replicated.
* ``conv1d`` / ``conv2d`` / ``conv3d``: the batch dim keeps its shard, the
  weight's output-channel shard (``groups=1``) becomes the output channel
  shard; other dims are unsharded.
* ``vstack`` / ``hstack`` / ``dstack`` / ``atleast_1d`` / ``atleast_2d`` /
  ``atleast_3d``: decomposed into ``cat`` / ``unsqueeze`` / ``reshape``, which
  have their own rules.
"""
from __future__ import annotations

from hyper_parallel.core.shard.ops.base import (
    DistributedOp, Strategy, register_decomposition, unshard_dims)
from hyper_parallel.core.shard.ops.base import is_dtensor as _is_dt, bind_args as _bind
from hyper_parallel.platform import get_platform


def _self(call, what="input"):
    if not call.args or not _is_dt(call.args[0]):
        raise NotImplementedError(f"{call.name}: the {what} must be a DTensor")
    return call.layouts[0], call.shapes[0]


def _np(layout):
    return layout.without_partial() if layout.has_partial() else layout


class PadRule(DistributedOp):
    float_args_matter = True  # a zero pad value keeps Partial

    def strategy(self, call):
        lay, shape = _self(call)
        v = _bind(call.args, call.kwargs, ("input", "pad", "mode", "value"))
        pad = list(v["pad"])
        nd = len(shape)
        dims = list(range(nd - len(pad) // 2, nd))
        tgt = unshard_dims(lay, dims)
        if not (v.get("mode", "constant") == "constant" and not v.get("value")):
            tgt = _np(tgt)
        return Strategy([tgt], tgt)


class RepeatInterleaveRule(DistributedOp):
    float_args_matter = False

    def strategy(self, call):
        lay, shape = _self(call)
        v = _bind(call.args, call.kwargs, ("input", "repeats", "dim"))
        rest = [l.replicated(len(s)) for l, s in zip(call.layouts[1:], call.shapes[1:])]
        if v.get("dim") is None:  # flattens: no shard survives (repeating is linear: Partial passes)
            return Strategy([lay.with_dim_map(((),) * len(shape), lay.partial)] + rest,
                            lay.with_dim_map(((),), lay.partial))
        dims = [v["dim"] % len(shape)]
        if rest:  # a tensor of repeats: the output size is data-dependent, so its global shape is derived from
            # the local result assuming even shards; dims that do not split evenly are unsharded too
            ms = lay.mesh_shape
            for t, m in enumerate(lay.dim_map):
                n = 1
                for d in m:
                    n *= ms[d]
                if m and shape[t] % n:
                    dims.append(t)
        tgt = unshard_dims(lay, dims)
        return Strategy([tgt] + rest, tgt)


class OuterRule(DistributedOp):
    float_args_matter = False

    def strategy(self, call):
        if len(call.layouts) != 2:
            raise NotImplementedError(f"{call.name}: both operands must be DTensors")
        a, b = _np(call.layouts[0]), _np(call.layouts[1])
        b_dm = b.dim_map[0] if not set(b.dim_map[0]) & set(a.dim_map[0]) else ()
        b = b.with_dim_map((b_dm,), b.partial)
        return Strategy([a, b], a.with_dim_map((a.dim_map[0], b_dm), a.partial))


class OneHotRule(DistributedOp):
    float_args_matter = False

    def strategy(self, call):
        lay, shape = _self(call)
        v = _bind(call.args, call.kwargs, ("input", "num_classes"))
        tgt = _np(lay)
        if v.get("num_classes", -1) in (-1, None):
            tgt = tgt.replicated(len(shape))
        return Strategy([tgt], tgt.with_dim_map(tuple(tgt.dim_map) + ((),), tgt.partial))


class HistcRule(DistributedOp):
    float_args_matter = True  # the range decides the strategy

    def strategy(self, call):
        lay, shape = _self(call)
        v = _bind(call.args, call.kwargs, ("input", "bins", "min", "max"))
        lo, hi = v.get("min", 0), v.get("max", 0)
        if lo == hi:  # the range comes from the data: every rank needs all of it
            return Strategy([lay.replicated(len(shape))], lay.replicated(1))
        tgt = _np(lay)
        partial = ["sum" if d in tgt.sharded_mesh_dims() else None for d in range(tgt.mesh_ndim)]
        return Strategy([tgt], tgt.with_dim_map(((),), partial))


class NonzeroRule(DistributedOp):
    float_args_matter = False

    def strategy(self, call):
        lay, shape = _self(call)
        v = _bind(call.args, call.kwargs, ("input",))
        tgt = lay.replicated(len(shape))
        if v.get("as_tuple"):
            return Strategy([tgt], [tgt.replicated(1)] * max(len(shape), 1))
        return Strategy([tgt], tgt.replicated(2))


class ConvRule(DistributedOp):
    float_args_matter = False

    def strategy(self, call):
        v = _bind(call.args, call.kwargs, ("input", "weight", "bias", "stride", "padding", "dilation", "groups"))
        if not (_is_dt(v.get("input")) and _is_dt(v.get("weight"))):
            raise NotImplementedError(f"{call.name}: input and weight must be DTensors")
        (x, xs), (w, ws) = (call.layouts[0], call.shapes[0]), (call.layouts[1], call.shapes[1])
        batched = len(xs) == len(ws)
        x_dm = [()] * len(xs)
        if batched:
            x_dm[0] = x.dim_map[0]
        used = set(x_dm[0]) if batched else set()
        w0 = w.dim_map[0] if v.get("groups", 1) == 1 and not set(w.dim_map[0]) & used else ()
        x_t = x.with_dim_map(x_dm, (None,) * x.mesh_ndim)
        w_t = w.with_dim_map([w0] + [()] * (len(ws) - 1), (None,) * w.mesh_ndim)
        targets = [x_t, w_t]
        if len(call.layouts) > 2:
            targets.append(call.layouts[2].with_dim_map((w0,), (None,) * w.mesh_ndim))
        out_dm = ([x_dm[0]] if batched else []) + [w0] + [()] * (len(xs) - (2 if batched else 1))
        return Strategy(targets, x.with_dim_map(out_dm, (None,) * x.mesh_ndim))


# ----------------------------------------------------------------------------- decompositions
def _seq(tensors):
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        return list(tensors[0]), True
    return list(tensors), len(tensors) > 1


def _atleast(n):
    def fn(*tensors):
        ts, many = _seq(tensors)
        out = []
        for t in ts:
            if t.dim() == 0:
                t = t.reshape((1,) * n)
            elif t.dim() == 1 and n >= 2:
                t = t.unsqueeze(0)
                if n == 3:
                    t = t.unsqueeze(-1)
            elif t.dim() == 2 and n == 3:
                t = t.unsqueeze(-1)
            out.append(t)
        return tuple(out) if many else out[0]
    return fn


def _stack_like(n, dim_of):
    ops = get_platform().ops

    def fn(tensors, *, out=None):
        if out is not None:
            raise NotImplementedError("vstack/hstack/dstack on DTensors: out= is not supported")
        ts = [_atleast(n)(t) for t in tensors]
        return ops.cat(ts, dim_of(ts))
    return fn


def register_all():
    PadRule("pad")
    RepeatInterleaveRule("repeat_interleave")
    OuterRule("outer")
    OuterRule("ger")
    OneHotRule("one_hot")
    HistcRule("histc")
    NonzeroRule("nonzero")
    NonzeroRule("argwhere")
    for n in ("conv1d", "conv2d", "conv3d"):
        ConvRule(n)
    ops = get_platform().ops
    register_decomposition(ops.atleast_1d, _atleast(1))
    register_decomposition(ops.atleast_2d, _atleast(2))
    register_decomposition(ops.atleast_3d, _atleast(3))
    register_decomposition(ops.vstack, _stack_like(2, lambda ts: 0))
    register_decomposition(ops.row_stack, _stack_like(2, lambda ts: 0))
    register_decomposition(ops.hstack, _stack_like(1, lambda ts: 0 if ts[0].dim() == 1 else 1))
    register_decomposition(ops.dstack, _stack_like(3, lambda ts: 2))


__all__ = ["register_all"]
