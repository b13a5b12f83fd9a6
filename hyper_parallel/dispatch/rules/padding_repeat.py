"""Ops that pad, repeat or add dims: ``pad``, ``repeat_interleave``, ``outer``, ``one_hot``, ``atleast_*`` and the stacks.

* ``pad``: the padded dims (a pad other than ``(0, 0)``) are unsharded, the
  others keep their shards; Partial passes through a zero constant pad (linear), else it is reduced.
* ``repeat_interleave``: the repeated dim is unsharded (``dim=None`` flattens:
  with int repeats, dim 0's shards become the output's when the pieces line up
  (even shards always), the other dims are unsharded; else everything is
  replicated); a tensor of repeats is replicated (plain or DTensor), and
  with one, dims whose shards are uneven are unsharded as well (the data-dependent
  output shape is derived from the local result).
* ``outer`` / ``ger``: the first operand's shard goes to output dim 0, the
  second's to dim 1 (unsharded if it uses the same mesh dim).
* ``one_hot``: shards kept, the new class dim unsharded; with
  ``num_classes=-1`` (read from the data) the input is replicated.
* ``vstack`` / ``hstack`` / ``dstack`` / ``atleast_1d`` / ``atleast_2d`` /
  ``atleast_3d``: decomposed into ``cat`` / ``unsqueeze`` / ``reshape``, which
  have their own rules.
"""
from __future__ import annotations

from hyper_parallel.dispatch.rules.base import (
    DistributedOp, Strategy, register_decomposition, unshard_dims)
from hyper_parallel.dispatch.rules.base import bind_args as _bind, input_layout, uneven_dims
from hyper_parallel.dispatch.rules.conv import _pieces
import torch



def _self(call, what="input"):
    return input_layout(call, what)


def _np(layout):
    return layout.without_partial() if layout.has_partial() else layout


class PadRule(DistributedOp):
    float_args_matter = True  # a zero pad value keeps Partial

    def strategy(self, call):
        lay, shape = _self(call)
        v = _bind(call.args, call.kwargs, ("input", "pad", "mode", "value"))
        pad = list(v["pad"])
        nd = len(shape)
        # pad[2i], pad[2i + 1] pad dim nd - 1 - i; a dim padded by (0, 0) is untouched and keeps its shards
        dims = [nd - 1 - i for i in range(len(pad) // 2) if (pad[2 * i], pad[2 * i + 1]) != (0, 0)]
        tgt = unshard_dims(lay, dims)
        mode = v.get("mode", "constant")
        if not (mode == "constant" and not v.get("value")):
            tgt = _np(tgt)
        local_fn = None
        if mode != "constant" and tgt.sharded_mesh_dims():
            local_fn = _pad_empty_piece(call.func, pad)
        return Strategy([tgt], tgt, local_fn=local_fn)


def _pad_empty_piece(func, pad):
    """``pad`` for the reflect / replicate / circular modes, whose kernels refuse an empty dim: an empty
    piece of a kept (unpadded, sharded) dim gives an empty output of the padded shape, on the graph."""

    def fn(*args, **kwargs):
        x = _bind(args, kwargs, ("input",))["input"]
        if x.numel():
            return func(*args, **kwargs)
        shape = list(x.shape)
        for i in range(len(pad) // 2):
            shape[len(shape) - 1 - i] += pad[2 * i] + pad[2 * i + 1]
        return x.new_zeros(shape) + x.sum() * 0
    return fn


class RepeatInterleaveRule(DistributedOp):
    float_args_matter = False

    def strategy(self, call):
        lay, shape = _self(call)
        v = _bind(call.args, call.kwargs, ("input", "repeats", "dim"))
        rest = [l.replicated(len(s)) for l, s in zip(call.layouts[1:], call.shapes[1:])]
        if v.get("dim") is None:  # flattens (repeating is linear: Partial passes)
            kept = _flat_repeat_shards(lay, shape, v, rest)
            if kept:  # rows' shards of dim 0 are the output's shards: computed locally
                tgt = lay.with_dim_map((kept,) + ((),) * (len(shape) - 1), lay.partial)
                return Strategy([tgt], lay.with_dim_map((kept,), lay.partial))
            return Strategy([lay.with_dim_map(((),) * len(shape), lay.partial)] + rest,
                            lay.with_dim_map(((),), lay.partial))
        dims = [v["dim"] % len(shape)]
        if rest:  # a tensor of repeats: the output size is data-dependent, so its global shape is derived from
            # the local result assuming even shards; dims that do not split evenly are unsharded too
            dims += uneven_dims(lay, shape)
        tgt = unshard_dims(lay, dims)
        return Strategy([tgt] + rest, tgt)


def _flat_repeat_shards(lay, shape, bound, rest):
    """The mesh dims sharding dim 0 that ``repeat_interleave(x, r)`` (``dim=None``, int ``r``) can keep.

    The output is ``x.flatten()`` with each element repeated ``r`` times, so the rows held by a rank
    (dim 0 from ``o`` to ``o + e``; the other dims are taken whole) are output elements ``o * m`` to
    ``(o + e) * m``, ``m = r * (numel / rows)``. That is the rank's ``torch.chunk`` piece of the output
    exactly when every piece of dim 0, scaled by ``m``, is the matching piece of the output (always
    for even shards). Otherwise (or with ``output_size``, a global size) nothing is kept: ``()``.
    """
    r = bound.get("repeats")
    if rest or not shape or not lay.dim_map[0] or isinstance(r, bool) or not isinstance(r, int) or \
            bound.get("output_size") is not None:
        return ()
    m = r
    for n in shape[1:]:
        m *= n
    kept, ms = tuple(lay.dim_map[0]), lay.mesh_shape
    rows, flat = _pieces(shape[0], kept, ms), _pieces(shape[0] * m, kept, ms)
    return kept if all((e * m, o * m) == f for (e, o), f in zip(rows, flat)) else ()


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


# ----------------------------------------------------------------------------- decompositions
def _seq(tensors):
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        return list(tensors[0]), True
    return list(tensors), len(tensors) > 1


def _atleast(ndim):
    def fn(*tensors):
        ts, many = _seq(tensors)
        out = []
        for t in ts:
            if t.dim() == 0:
                t = t.reshape((1,) * ndim)
            elif t.dim() == 1 and ndim >= 2:
                t = t.unsqueeze(0)
                if ndim == 3:
                    t = t.unsqueeze(-1)
            elif t.dim() == 2 and ndim == 3:
                t = t.unsqueeze(-1)
            out.append(t)
        return tuple(out) if many else out[0]
    return fn


def _stack_like(ndim, dim_of):
    ops = torch

    def fn(tensors, *, out=None):
        if out is not None:
            raise NotImplementedError("vstack/hstack/dstack on DTensors: out= is not supported")
        ts = [_atleast(ndim)(t) for t in tensors]
        return ops.cat(ts, dim_of(ts))
    return fn


def register_all():
    PadRule("pad")
    RepeatInterleaveRule("repeat_interleave")
    OuterRule("outer")
    OuterRule("ger")
    OneHotRule("one_hot")
    ops = torch
    register_decomposition(ops.atleast_1d, _atleast(1))
    register_decomposition(ops.atleast_2d, _atleast(2))
    register_decomposition(ops.atleast_3d, _atleast(3))
    register_decomposition(ops.vstack, _stack_like(2, lambda ts: 0))
    register_decomposition(ops.row_stack, _stack_like(2, lambda ts: 0))
    register_decomposition(ops.hstack, _stack_like(1, lambda ts: 0 if ts[0].dim() == 1 else 1))
    register_decomposition(ops.dstack, _stack_like(3, lambda ts: 2))


__all__ = ["register_all"]
