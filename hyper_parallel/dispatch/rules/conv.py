"""``conv1d`` / ``conv2d`` / ``conv3d`` on DTensors (``ConvRule``): computed locally where a layout allows it.

Batch shards, pointwise spatial shards (kernel 1, stride 1, no padding), row parallel (input channels
sharded -> ``Partial(sum)``, bias added once), column parallel, and group-aligned channel shards
(``groups > 1``) keep their shard; other dims are unsharded.
"""
from __future__ import annotations

from hyper_parallel.dtensor.layout import chunk_size_and_offset
from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt, bind_args as _bind
import torch



_CONV_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _per_dim(value, spatial_dims, what, name):
    """``stride`` / ``dilation`` / integer ``padding`` as one int per spatial dim."""
    if isinstance(value, int):
        return (value,) * spatial_dims
    value = tuple(value)
    if len(value) == 1:
        return value * spatial_dims
    if len(value) != spatial_dims or not all(isinstance(e, int) for e in value):
        raise ValueError(f"{name}: {what}={value!r}: expected an int or {spatial_dims} ints (one per spatial dim)")
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

        def free(mesh_dims):
            return bool(mesh_dims) and not set(mesh_dims) & used

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


def _local_conv(func, groups, channels, pads, kernel, stride, dilation):
    """The conv on local pieces with this rank's number of groups; empty pieces (no input channels, no
    groups or an empty output) give zeros (+ bias), kept on the autograd graph."""
    ops = torch

    def fn(*args, **kwargs):
        v = _bind(args, kwargs, _CONV_NAMES)
        x, w, b = v["input"], v["weight"], v.get("bias")
        spatial = [(n + p - d * (k - 1) - 1) // s + 1
                   for n, p, k, s, d in zip(x.shape[channels + 1:], pads, kernel, stride, dilation)]
        shape = list(x.shape[:channels]) + [w.shape[0]] + spatial
        if groups and x.shape[channels] and all(n > 0 for n in shape):
            return func(x, w, b, v.get("stride", 1), v.get("padding", 0), v.get("dilation", 1), groups)
        out = ops.zeros(shape, dtype=x.dtype, device=x.device)
        if b is not None:
            out = out + b.reshape([-1] + [1] * len(spatial))
        return out + (x.sum() + w.sum()) * 0
    return fn



def register_all():
    for n in ("conv1d", "conv2d", "conv3d"):
        ConvRule(n)


__all__ = ["ConvRule", "register_all"]
