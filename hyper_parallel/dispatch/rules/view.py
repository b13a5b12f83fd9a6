"""View-like ops: reshape family, dim permutations, expand/broadcast, repeat.

Sharding follows the dims through the view; ``Partial`` passes through unchanged
(every op here is linear).

* ``view`` / ``reshape`` / ``flatten`` / ``unflatten`` / ``squeeze`` /
  ``unsqueeze`` / ``view_as`` / ``reshape_as`` / ``ravel``: input and output dims
  are matched in groups with equal products (like torch's ``view_groups``; size-1
  dims belong to no group). A shard on the outermost input dim of a group moves
  to the outermost output dim of the group when every rank's piece is the same
  contiguous flat range on both sides (always for a 1-to-1 group; for merges and
  splits when the sizes divide evenly, or more generally when the torch.chunk
  pieces line up). Otherwise the longest prefix of its mesh dims that lines up is
  kept and the rest is gathered first; shards on inner dims of a group and on
  size-1 dims are gathered. The local op is run with the *local* target shape.
* ``transpose`` / ``swapaxes`` / ``swapdims`` / ``permute`` / ``t`` / ``T`` /
  ``mT`` / ``movedim`` / ``moveaxis``: shards move with their dims, no
  communication.
* ``expand`` / ``expand_as`` / ``broadcast_to``: expanded size-1 dims and new
  leading dims are unsharded; the local op expands to the local shape.
* ``repeat`` / ``tile``: dims repeated more than once are unsharded first.
"""
from __future__ import annotations

import itertools

from hyper_parallel.dtensor.layout import local_shape_and_offset
from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, meta_run
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt
from hyper_parallel.dtensor import torch_internals
import torch




def _prod(sizes):
    p = 1
    for x in sizes:
        p *= x
    return p


def _self_layout(call):
    if not call.args or not _is_dt(call.args[0]):
        raise NotImplementedError(f"{call.name}: the tensor being viewed must be a DTensor")
    return call.layouts[0], call.shapes[0]


def _out_shape(call):
    out = meta_run(call.func, call.args, call.kwargs)
    return tuple(out.shape)


def _rest(call):
    """Target layouts for DTensor arguments after the first: keep them as they are."""
    return [None] * (len(call.layouts) - 1)


# ----------------------------------------------------------------------------- reshape family
def view_groups(in_shape, out_shape):
    """Pairs (input dims, output dims) of equal products, size-1 dims left out (no zero-size dims)."""
    ia = [i for i, s in enumerate(in_shape) if s != 1]
    ib = [j for j, s in enumerate(out_shape) if s != 1]
    groups = []
    i = j = 0
    while i < len(ia) and j < len(ib):
        gi, gj = [ia[i]], [ib[j]]
        pa, pb = in_shape[ia[i]], out_shape[ib[j]]
        i += 1
        j += 1
        while pa != pb:
            if pa < pb:
                if i >= len(ia):
                    raise ValueError(f"cannot view shape {tuple(in_shape)} as {tuple(out_shape)}")
                gi.append(ia[i])
                pa *= in_shape[ia[i]]
                i += 1
            else:
                if j >= len(ib):
                    raise ValueError(f"cannot view shape {tuple(in_shape)} as {tuple(out_shape)}")
                gj.append(ib[j])
                pb *= out_shape[ib[j]]
                j += 1
        groups.append((gi, gj))
    return groups


def _pieces_line_up(in_size, in_inner, out_size, out_inner, mesh_dims, mesh_shape):
    """Whether sharding (in_size x in_inner) on its outer dim and (out_size x out_inner) on its outer dim
    by ``mesh_dims`` gives every rank the same flat range."""
    ranges = [range(mesh_shape[d]) for d in mesh_dims]
    coord = [0] * len(mesh_shape)
    for c in itertools.product(*ranges):
        for d, v in zip(mesh_dims, c):
            coord[d] = v
        (si,), (oi,) = local_shape_and_offset((in_size,), mesh_shape, (tuple(mesh_dims),), coord)
        (so,), (oo,) = local_shape_and_offset((out_size,), mesh_shape, (tuple(mesh_dims),), coord)
        if si * in_inner != so * out_inner or oi * in_inner != oo * out_inner:
            return False
    return True


def reshape_layouts(layout, in_shape, out_shape):
    """(input target layout, output layout) for viewing ``in_shape`` as ``out_shape``."""
    nin, nout = len(in_shape), len(out_shape)
    if 0 in tuple(in_shape) or 0 in tuple(out_shape):
        return (layout.with_dim_map(((),) * nin, layout.partial),
                layout.with_dim_map(((),) * nout, layout.partial))
    in_dm = [()] * nin
    out_dm = [()] * nout
    for gi, gj in view_groups(in_shape, out_shape):
        a0, b0 = gi[0], gj[0]
        ms = layout.dim_map[a0]
        if not ms:
            continue
        in_inner = _prod(in_shape[g] for g in gi[1:])
        out_inner = _prod(out_shape[g] for g in gj[1:])
        for n in range(len(ms), 0, -1):
            if _pieces_line_up(in_shape[a0], in_inner, out_shape[b0], out_inner, ms[:n], layout.mesh_shape):
                in_dm[a0] = tuple(ms[:n])
                out_dm[b0] = tuple(ms[:n])
                break
    return layout.with_dim_map(in_dm, layout.partial), layout.with_dim_map(out_dm, layout.partial)


class ReshapeRule(DistributedOp):
    """view / reshape / flatten / unflatten / squeeze / unsqueeze / view_as / reshape_as / ravel."""

    def __init__(self, op_name, use_view=False):
        self.use_view = use_view
        super().__init__(op_name)

    def strategy(self, call):
        lay, in_shape = _self_layout(call)
        if call.name == "view" and _is_dtype_view(call):
            return _dtype_view(call, lay, in_shape)
        out_shape = _out_shape(call)
        tgt, out = reshape_layouts(lay, in_shape, out_shape)
        local_shape = tuple(out.local_shape(out_shape, coord=call.mesh.get_coordinate()))
        if self.use_view:
            def local_fn(local, *args, **kwargs):
                try:
                    return local.view(local_shape)
                except RuntimeError:  # local piece not viewable (e.g. transposed locally): copy like reshape
                    return local.reshape(local_shape)
        else:
            def local_fn(local, *args, **kwargs):
                return local.reshape(local_shape)
        return Strategy([tgt] + _rest(call), out, local_fn=local_fn,
                        out_shapes=torch.Size(out_shape))


def _is_dtype_view(call):
    rest = list(call.args[1:]) + list(call.kwargs.values())
    return len(rest) == 1 and type(rest[0]).__name__ == "dtype"


def _dtype_view(call, lay, in_shape):
    """view(dtype): same element size keeps the layout; otherwise the last dim is unsharded."""
    new = (list(call.args[1:]) + list(call.kwargs.values()))[0]
    old_size = call.itemsizes[0]
    new_size = torch_internals.meta_empty((), new).element_size()
    if old_size == new_size or not in_shape:
        return Strategy([lay] + _rest(call), lay)
    nd = len(in_shape)
    dm = list(lay.dim_map)
    dm[nd - 1] = ()
    tgt = lay.with_dim_map(dm, (None,) * lay.mesh_ndim)
    return Strategy([tgt] + _rest(call), tgt)


# ----------------------------------------------------------------------------- permutations
class PermuteRule(DistributedOp):
    """transpose / swapaxes / swapdims / permute / t / T / mT / movedim / moveaxis: shards follow the dims."""

    def strategy(self, call):
        lay, shape = _self_layout(call)
        nd = len(shape)
        probe_shape = tuple(range(2, nd + 2))  # distinct sizes identify the dims
        probe = torch_internals.meta_empty(probe_shape, call.dtensor_args[0].dtype)
        out = call.func(probe, *call.args[1:], **call.kwargs)
        perm = [probe_shape.index(s) for s in out.shape]
        dm = [lay.dim_map[p] for p in perm]
        return Strategy([lay] + _rest(call), lay.with_dim_map(dm, lay.partial))


# ----------------------------------------------------------------------------- expand / repeat
class ExpandRule(DistributedOp):
    """expand / expand_as / broadcast_to: broadcast (size-1 -> n) and new leading dims are unsharded."""

    def strategy(self, call):
        lay, in_shape = _self_layout(call)
        out_shape = _out_shape(call)
        nin, nout = len(in_shape), len(out_shape)
        off = nout - nin
        in_dm = list(lay.dim_map)
        out_dm = [()] * nout
        for i in range(nin):
            if in_shape[i] != out_shape[off + i]:
                in_dm[i] = ()
            out_dm[off + i] = in_dm[i]
        tgt = lay.with_dim_map(in_dm, lay.partial)
        out = lay.with_dim_map(out_dm, lay.partial)
        local_shape = tuple(out.local_shape(out_shape, coord=call.mesh.get_coordinate()))

        def local_fn(local, *args, **kwargs):
            return local.expand(local_shape)
        return Strategy([tgt] + _rest(call), out, local_fn=local_fn, out_shapes=torch.Size(out_shape))


def _sizes_arg(args, kwargs, key):
    if key in kwargs:
        s = kwargs[key]
    elif len(args) == 1 and isinstance(args[0], (list, tuple)) or len(args) == 1 and hasattr(args[0], "__iter__"):
        s = args[0]
    else:
        s = args
    return tuple(int(v) for v in s)


class RepeatRule(DistributedOp):
    """repeat / tile: dims repeated more than once (and new leading dims) are unsharded."""

    def strategy(self, call):
        lay, in_shape = _self_layout(call)
        reps = _sizes_arg(call.args[1:], call.kwargs, "repeats" if call.name == "repeat" else "dims")
        nin = len(in_shape)
        if call.name == "tile" and len(reps) < nin:
            reps = (1,) * (nin - len(reps)) + reps
        nout = len(reps)
        off = nout - nin
        in_dm = list(lay.dim_map)
        out_dm = [()] * nout
        for i in range(nin):
            if reps[off + i] != 1:
                in_dm[i] = ()
            out_dm[off + i] = in_dm[i]
        tgt = lay.with_dim_map(in_dm, lay.partial)
        return Strategy([tgt] + _rest(call), lay.with_dim_map(out_dm, lay.partial))


# ----------------------------------------------------------------------------- registration
RESHAPE_OPS = ["reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "reshape_as", "ravel"]
VIEW_OPS = ["view", "view_as"]
PERMUTE_OPS = ["transpose", "swapaxes", "swapdims", "permute", "t", "T", "mT", "movedim", "moveaxis"]
EXPAND_OPS = ["expand", "expand_as", "broadcast_to"]
REPEAT_OPS = ["repeat", "tile"]


def register_all():
    for n in RESHAPE_OPS:
        ReshapeRule(n)
    for n in VIEW_OPS:
        ReshapeRule(n, use_view=True)
    for n in PERMUTE_OPS:
        PermuteRule(n)
    for n in EXPAND_OPS:
        ExpandRule(n)
    for n in REPEAT_OPS:
        RepeatRule(n)
