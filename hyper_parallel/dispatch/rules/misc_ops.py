"""Ops of HyperParallel's operator list not covered by the other families.

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
* ``histc``: with an explicit range, each rank counts its own shard and the
  result is ``Partial(sum)`` (nothing moves until it is read); with the
  data-dependent default range the input is replicated.
* ``nonzero`` / ``argwhere``: data-dependent shape: replicated.
* ``conv1d`` / ``conv2d`` / ``conv3d``: computed locally where a layout allows
  it (``ConvRule``): batch shards, pointwise spatial shards (kernel 1, stride 1,
  no padding), row parallel (input channels sharded -> ``Partial(sum)``, bias
  added once), column parallel, and group-aligned channel shards (``groups > 1``);
  other dims are unsharded.
* ``vstack`` / ``hstack`` / ``dstack`` / ``atleast_1d`` / ``atleast_2d`` /
  ``atleast_3d``: decomposed into ``cat`` / ``unsqueeze`` / ``reshape``, which
  have their own rules.
"""
from __future__ import annotations

from hyper_parallel.dtensor.layout import chunk_size_and_offset
from hyper_parallel.dispatch.rules.base import (
    DistributedOp, Strategy, register_decomposition, unshard_dims)
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt, bind_args as _bind, input_layout, uneven_dims
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


def _flat_repeat_shards(lay, shape, v, rest):
    """The mesh dims sharding dim 0 that ``repeat_interleave(x, r)`` (``dim=None``, int ``r``) can keep.

    The output is ``x.flatten()`` with each element repeated ``r`` times, so the rows held by a rank
    (dim 0 from ``o`` to ``o + e``; the other dims are taken whole) are output elements ``o * m`` to
    ``(o + e) * m``, ``m = r * (numel / rows)``. That is the rank's ``torch.chunk`` piece of the output
    exactly when every piece of dim 0, scaled by ``m``, is the matching piece of the output (always
    for even shards). Otherwise (or with ``output_size``, a global size) nothing is kept: ``()``.
    """
    r = v.get("repeats")
    if rest or not shape or not lay.dim_map[0] or isinstance(r, bool) or not isinstance(r, int) or \
            v.get("output_size") is not None:
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


_CONV_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _per_dim(value, n, what, name):
    """``stride`` / ``dilation`` / integer ``padding`` as one int per spatial dim."""
    if isinstance(value, int):
        return (value,) * n
    value = tuple(value)
    if len(value) == 1:
        return value * n
    if len(value) != n or not all(isinstance(e, int) for e in value):
        raise ValueError(f"{name}: {what}={value!r}: expected an int or {n} ints (one per spatial dim)")
    return value


def _paddings(padding, kernel, dilation, name):
    """Total padding per spatial dim (``"valid"``: 0; ``"same"``: ``dilation * (kernel - 1)``)."""
    n = len(kernel)
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * n
        if padding == "same":
            return tuple(d * (k - 1) for k, d in zip(kernel, dilation))
        raise ValueError(f"{name}: padding={padding!r}: expected 'valid', 'same', an int or {n} ints")
    return tuple(2 * p for p in _per_dim(padding, n, "padding", name))


def _pieces(size, mesh_dims, mesh_shape):
    """(extent, offset) of every piece of a dim of ``size`` split over ``mesh_dims`` (nested torch.chunk)."""
    out = [(size, 0)]
    for d in mesh_dims:
        out = [(e, o + st) for s, o in out
               for e, st in (chunk_size_and_offset(s, mesh_shape[d], i) for i in range(mesh_shape[d]))]
    return out


def _groups_aligned(c_in, c_out, groups, mesh_dims, mesh_shape):
    """Whether splitting the input channels and the output channels over ``mesh_dims`` gives every
    piece whole groups, the same groups on both sides."""
    a, b = c_in // groups, c_out // groups
    if not a or not b or c_in != a * groups or c_out != b * groups:
        return False
    for (ei, oi), (eo, oo) in zip(_pieces(c_in, mesh_dims, mesh_shape), _pieces(c_out, mesh_dims, mesh_shape)):
        if ei % a or oi % a or eo % b or oo % b or ei // a != eo // b or oi // a != oo // b:
            return False
    return True


class ConvRule(DistributedOp):
    """conv1d / conv2d / conv3d: every kept shard is computed locally.

    * batch dim: its shard is kept (output batch shard);
    * spatial dim with kernel size 1, stride 1 and no padding along it: its shard is kept
      (the conv is pointwise along it; output shard on the same dim); other spatial dims unsharded;
    * ``groups == 1``, input channels sharded (input dim 1 and weight dim 1 alike; a replicated
      side is split locally): row parallel, the output is ``Partial(sum)`` on those mesh dims and
      the bias becomes ``Partial`` there (kept on one rank, zeros on the others: added once);
    * ``groups == 1``, weight output channels sharded: column parallel, output channel shard;
    * ``groups > 1``: channel shards that give every rank whole groups, the same groups for the
      input channels and the weight's output channels (one side may be replicated: split
      locally), are kept: each rank convolves its own groups (output channel shard);
    * the input keeps its shards first (batch, spatial, channels); the weight adapts.
    """

    float_args_matter = False

    def strategy(self, call):
        v = _bind(call.args, call.kwargs, _CONV_NAMES)
        if not (_is_dt(v.get("input")) and _is_dt(v.get("weight"))):
            raise NotImplementedError(f"{call.name}: input and weight must be DTensors")
        (x, xs), (w, ws) = (call.layouts[0], call.shapes[0]), (call.layouts[1], call.shapes[1])
        nsp = len(ws) - 2
        if nsp < 1 or len(xs) not in (nsp + 1, nsp + 2):
            raise ValueError(f"{call.name}: input of shape {tuple(xs)} and weight of shape {tuple(ws)}: expected "
                             f"a weight (out_channels, in_channels / groups, *kernel) and an input of "
                             f"{nsp + 1} or {nsp + 2} dims")
        groups = v.get("groups", 1)
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"{call.name}: groups={groups!r}: expected a positive int")
        kernel = tuple(ws[2:])
        stride = _per_dim(v.get("stride", 1), nsp, "stride", call.name)
        dilation = _per_dim(v.get("dilation", 1), nsp, "dilation", call.name)
        pads = _paddings(v.get("padding", 0), kernel, dilation, call.name)
        batched = len(xs) == nsp + 2
        c = 1 if batched else 0
        ms = x.mesh_shape
        xdm, wdm = x.dim_map, w.dim_map

        batch = tuple(xdm[0]) if batched else ()
        used = set(batch)
        spatial = {}
        for j in range(nsp):
            t = c + 1 + j
            m = tuple(xdm[t])
            if m and kernel[j] == 1 and stride[j] == 1 and pads[j] == 0 and not set(m) & used:
                spatial[t] = m
                used |= set(m)

        def free(m):
            return bool(m) and not set(m) & used

        cx, w0, w1 = tuple(xdm[c]), tuple(wdm[0]), tuple(wdm[1])
        row = chan = ()
        if groups == 1:
            row = cx if free(cx) else (w1 if free(w1) else ())
            used |= set(row)
            out_ch = w0 if free(w0) else ()
        else:
            c_in, c_out = xs[c], ws[0]
            for m in (cx, w0):
                if free(m) and _groups_aligned(c_in, c_out, groups, m, ms):
                    chan = m
                    break
            out_ch = chan

        x_dm = [()] * len(xs)
        if batched:
            x_dm[0] = batch
        x_dm[c] = row or chan
        for t, m in spatial.items():
            x_dm[t] = m
        w_dm = [out_ch, row] + [()] * nsp
        none = (None,) * x.mesh_ndim
        partial = tuple("sum" if d in row else None for d in range(x.mesh_ndim))
        targets = [x.with_dim_map(x_dm, none), w.with_dim_map(w_dm, none)]
        has_bias = len(call.layouts) > 2
        if has_bias:  # Partial(sum) on the row-parallel mesh dims: the bias is kept on one rank, added once
            targets.append(call.layouts[2].with_dim_map((out_ch,), partial))
        out_dm = ([batch] if batched else []) + [out_ch] + [spatial.get(c + 1 + j, ()) for j in range(nsp)]
        out = x.with_dim_map(out_dm, partial)
        local_groups = groups
        coord = call.mesh.get_coordinate()
        if chan and coord is not None:  # (a rank outside the mesh runs nothing)
            lshape, _ = targets[0].local_shape_and_offset(xs, coord=coord)
            local_groups = lshape[c] // (xs[c] // groups)
        return Strategy(targets, out, local_fn=_local_conv(call.func, local_groups, c, pads, kernel, stride,
                                                           dilation))


def _local_conv(func, groups, c, pads, kernel, stride, dilation):
    """The conv on local pieces with this rank's number of groups; empty pieces (no input channels, no
    groups or an empty output) give zeros (+ bias), kept on the autograd graph."""
    ops = torch

    def fn(*args, **kwargs):
        v = _bind(args, kwargs, _CONV_NAMES)
        x, w, b = v["input"], v["weight"], v.get("bias")
        spatial = [(n + p - d * (k - 1) - 1) // s + 1
                   for n, p, k, s, d in zip(x.shape[c + 1:], pads, kernel, stride, dilation)]
        shape = list(x.shape[:c]) + [w.shape[0]] + spatial
        if groups and x.shape[c] and all(n > 0 for n in shape):
            return func(x, w, b, v.get("stride", 1), v.get("padding", 0), v.get("dilation", 1), groups)
        out = ops.zeros(shape, dtype=x.dtype, device=x.device)
        if b is not None:
            out = out + b.reshape([-1] + [1] * len(spatial))
        return out + (x.sum() + w.sum()) * 0
    return fn


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
    ops = torch

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
    ops = torch
    register_decomposition(ops.atleast_1d, _atleast(1))
    register_decomposition(ops.atleast_2d, _atleast(2))
    register_decomposition(ops.atleast_3d, _atleast(3))
    register_decomposition(ops.vstack, _stack_like(2, lambda ts: 0))
    register_decomposition(ops.row_stack, _stack_like(2, lambda ts: 0))
    register_decomposition(ops.hstack, _stack_like(1, lambda ts: 0 if ts[0].dim() == 1 else 1))
    register_decomposition(ops.dstack, _stack_like(3, lambda ts: 2))


__all__ = ["register_all"]
