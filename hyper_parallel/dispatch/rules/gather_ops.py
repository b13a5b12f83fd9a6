"""``gather`` and ``index_select`` that compute locally on a sharded gather / select dim.

Both ops read input rows chosen by an integer index. When the input's gather
(select) dim ``dim`` is sharded on mesh dims ``M``, every rank holds a
contiguous piece ``[start, start + n)`` of that dim; it looks up only the index
entries that fall in its piece (index shifted by ``start``, others clamped and
then zeroed) and the output is ``Partial(sum)`` over ``M``: exactly one rank of
``M`` holds each element's value, the others hold 0. The backward of the masked
local lookup adds each gradient entry into the rank's own piece only, so the
gradient is the single-process one (no communication in forward or backward for
this op). HyperParallel's ``GatherDDistributedOp`` / ``IndexSelectDistributedOp``
compute the same layouts this way.

* ``gather(input, dim, index)``: the output is laid out like the index (its shards
  on every dim, ``dim`` included). On a dim ``t != dim`` where input and index
  have the same size, the two share one shard: the index's, or the input's when
  the index is whole there (then the index is split locally); where the sizes
  differ both are whole there. The input keeps its shard on ``dim`` unless a mesh
  dim is needed by those shards. Partial(sum) inputs stay pending; other
  pending reductions of the input are done first when ``dim`` is sharded.
  A plain index tensor counts as replicated: the input's other dims are then whole.
* ``index_select(input, dim, index)``: the output keeps the input's shards on the
  other dims; dim ``dim`` takes the 1-d index's shard (when its mesh dims are free)
  and ``Partial(sum)`` over ``M``. A plain index tensor counts as replicated.

Index entries outside ``[0, size)`` of the global dim raise ``IndexError`` for
CPU index tensors (as torch does); on accelerators they are not checked (a check
would synchronise the device) and contribute 0.
"""
from __future__ import annotations

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt, bind_args as _bind
from hyper_parallel.compile import compile_mode
import torch

_NAMES = ("input", "dim", "index", "sparse_grad")


def _roles(call):
    """Argument values by name and the name of every DTensor input, in the dispatcher's order."""
    v = _bind(call.args, call.kwargs, _NAMES)
    roles = [(_NAMES[i] if i < len(_NAMES) else f"arg{i}") for i, a in enumerate(call.args) if _is_dt(a)]
    roles += [k for k, a in call.kwargs.items() if _is_dt(a)]
    return v, roles


def _norm_dim(name, dim, ndim):
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name}: dim must be an int, got {dim!r}")
    size = max(ndim, 1)
    if not -size <= dim < size:
        raise IndexError(f"{name}: dim {dim} is out of range for a {ndim}-d input (expected {-size} <= dim < {size})")
    return dim % size


def _keep_partials(layout, busy, sharded_dim):
    """The input's pending reductions that survive: none on ``busy`` mesh dims; with a sharded
    gather dim only ``sum`` ones (the output adds a Partial(sum))."""
    return tuple(None if d in busy or (sharded_dim and p != "sum") else p for d, p in enumerate(layout.partial))


def _piece(layout, shape, dim, mesh):
    """(start, length) of this rank's piece of ``dim`` under ``layout``."""
    lshape, off = layout.local_shape_and_offset(shape, coord=mesh.get_coordinate())
    return off[dim], lshape[dim]


def _check_range(name, index, size):
    """torch's own out-of-range error, for CPU index tensors (no device synchronisation there)."""
    if compile_mode is not None and compile_mode.is_compiling():
        return
    if index.device.type != "cpu" or index.numel() == 0:
        return
    lo, hi = int(index.min()), int(index.max())
    if lo < 0 or hi >= size:
        bad = lo if lo < 0 else hi
        raise IndexError(f"{name}: index {bad} is out of bounds for dim of size {size} "
                         f"(expected 0 <= index < {size})")


def _masked_gather(start, length, size):
    """gather on this rank's piece [start, start + length) of the gather dim; other entries 0."""
    ops = torch

    def fn(*args, **kwargs):
        v = _bind(args, kwargs, _NAMES)
        x, dim, index = v["input"], v["dim"], v["index"]
        _check_range("gather", index, size)
        if length == 0:  # no piece of the dim here: zeros, still on the autograd graph
            out = x.new_zeros(tuple(index.shape))
            return out + x.sum() * 0 if x.requires_grad else out
        local = index - start
        outside = (local < 0) | (local >= length)
        out = ops.gather(x, dim, local.clamp(0, length - 1), sparse_grad=bool(v.get("sparse_grad", False)))
        return out.masked_fill(outside, 0)
    return fn


def _masked_index_select(start, length, size):
    """index_select on this rank's piece [start, start + length) of the select dim; other rows 0."""
    ops = torch

    def fn(*args, **kwargs):
        v = _bind(args, kwargs, _NAMES)
        x, dim, index = v["input"], v["dim"], v["index"]
        _check_range("index_select", index, size)
        nd = x.dim()
        dim = dim % nd
        shape = list(x.shape)
        shape[dim] = index.numel()
        if length == 0:
            out = x.new_zeros(shape)
            return out + x.sum() * 0 if x.requires_grad else out
        local = index.reshape(-1) - start
        outside = (local < 0) | (local >= length)
        out = ops.index_select(x, dim, local.clamp(0, length - 1))
        mask_shape = [1] * nd
        mask_shape[dim] = -1
        return out.masked_fill(outside.reshape(mask_shape), 0)
    return fn


class GatherRule(DistributedOp):
    """gather(input, dim, index[, sparse_grad]): output laid out like the index (module docstring)."""

    float_args_matter = False

    def strategy(self, call):
        v, roles = _roles(call)
        if "input" not in roles:
            raise NotImplementedError("gather: the input must be a DTensor")
        lay = dict(zip(roles, call.layouts))
        shp = dict(zip(roles, call.shapes))
        ilay, ishape = lay["input"], shp["input"]
        plain_index = "index" not in roles
        if plain_index:  # a plain index tensor counts as replicated (it cannot be split: nothing shares it)
            index = v.get("index")
            if not hasattr(index, "shape") or not hasattr(index, "dim"):
                raise TypeError(f"gather: index must be a tensor, got {type(index).__name__}")
            xshape = tuple(index.shape)
            xlay = ilay.with_dim_map(((),) * len(xshape), (None,) * ilay.mesh_ndim)
        else:
            xlay, xshape = lay["index"], shp["index"]
        nd = len(ishape)
        if len(xshape) != nd:
            raise ValueError(f"gather: index must have as many dims as input, got index of shape {tuple(xshape)} "
                             f"for input of shape {tuple(ishape)}")
        dim = _norm_dim("gather", v.get("dim"), nd)
        if nd == 0:
            return Strategy([ilay.without_partial() if r == "input" else xlay.without_partial() for r in roles],
                            xlay.without_partial())
        idx_mesh = set(xlay.sharded_mesh_dims())
        # dims t != dim: one shard for input and index (the index's, else the input's), or none
        dm = [()] * nd
        for t in range(nd):
            if t == dim or xshape[t] != ishape[t] or plain_index:
                continue
            xm, im = xlay.dim_map[t], ilay.dim_map[t]
            dm[t] = xm if xm else (im if not set(im) & idx_mesh else ())
        used = {d for t, m in enumerate(dm) if t != dim for d in m}
        # the gather dim: the index keeps its shard (the output's); the input keeps its own if it is free
        xd = tuple(d for d in xlay.dim_map[dim] if d not in used)
        if len(xd) != len(xlay.dim_map[dim]):
            xd = ()
        busy = used | set(xd)
        mm = ilay.dim_map[dim] if not set(ilay.dim_map[dim]) & busy else ()
        in_dm = list(dm)
        in_dm[dim] = mm
        out_dm = list(dm)
        out_dm[dim] = xd
        in_partial = _keep_partials(ilay, busy, bool(mm))
        in_tgt = ilay.with_dim_map(in_dm, in_partial)
        x_tgt = xlay.with_dim_map(out_dm, (None,) * xlay.mesh_ndim)
        out_partial = list(in_partial)
        for d in mm:
            out_partial[d] = "sum"
        out = xlay.with_dim_map(out_dm, tuple(out_partial))
        local_fn = None
        if mm:
            start, length = _piece(in_tgt, ishape, dim, call.mesh)
            local_fn = _masked_gather(start, length, ishape[dim])
        targets = [in_tgt if r == "input" else x_tgt for r in roles]
        return Strategy(targets, out, local_fn=local_fn)


class IndexSelectRule(DistributedOp):
    """index_select(input, dim, index): other dims keep their shards; a sharded ``dim`` gives Partial(sum)."""

    float_args_matter = False

    def strategy(self, call):
        v, roles = _roles(call)
        if not roles or roles[0] != "input":
            raise NotImplementedError("index_select: the input (first argument) must be a DTensor")
        lay = dict(zip(roles, call.layouts))
        shp = dict(zip(roles, call.shapes))
        ilay, ishape = lay["input"], shp["input"]
        nd = len(ishape)
        dim = _norm_dim("index_select", v.get("dim"), nd)
        xlay = lay.get("index")
        if xlay is not None and len(shp["index"]) > 1:
            raise IndexError(f"index_select: index must be 0-d or 1-d, got shape {tuple(shp['index'])}")
        if nd == 0:
            targets = [ilay if r == "input" else lay[r].replicated() for r in roles]
            return Strategy(targets, ilay)
        used = {d for t, m in enumerate(ilay.dim_map) if t != dim for d in m}
        mm = ilay.dim_map[dim]
        xd = ()
        if xlay is not None and xlay.ndim == 1:
            xd = xlay.dim_map[0]
            if set(xd) & (used | set(mm)):
                xd = ()
        in_partial = _keep_partials(ilay, set(xd), bool(mm))
        in_tgt = ilay.with_dim_map(ilay.dim_map, in_partial)
        out_dm = list(ilay.dim_map)
        out_dm[dim] = xd
        out_partial = list(in_partial)
        for d in mm:
            out_partial[d] = "sum"
        out = ilay.with_dim_map(out_dm, tuple(out_partial))
        local_fn = None
        if mm:
            start, length = _piece(in_tgt, ishape, dim, call.mesh)
            local_fn = _masked_index_select(start, length, ishape[dim])
        targets = []
        for r in roles:
            if r == "input":
                targets.append(in_tgt)
            elif r == "index":
                targets.append(xlay.with_dim_map((xd,) if xlay.ndim == 1 else (), (None,) * xlay.mesh_ndim))
            else:
                targets.append(lay[r].replicated())
        return Strategy(targets, out, local_fn=local_fn)


def register_all():
    GatherRule("gather")
    IndexSelectRule("index_select")
