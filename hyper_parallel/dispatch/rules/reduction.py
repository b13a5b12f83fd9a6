"""Reductions: sum, mean, max/min/amax/amin/argmax/argmin, prod, norm, any/all, var/std, logsumexp.

* Linear reductions (sum, mean, nansum) over a sharded dim give ``Partial(sum)``
  with no communication; ``mean`` is computed as local sum / global count, so
  it is exact for uneven shards too. Partial(sum) inputs stay partial.
* ``prod``, ``all``, ``any`` over a sharded dim reduce locally and give
  ``Partial(prod)``, ``Partial("all")``, ``Partial("any")`` (an empty shard gives
  the identity 1 / True / False); inputs pending the same op stay partial.
* ``max()``/``min()``/``amax``/``amin``: ``Partial(max/min)`` (see ``_extremum_strategy``);
  ``max(dim)``/``min(dim)`` on HyperParallel meshes: values ``Partial(max/min)``,
  global indices (``extremum_dim.py``); on PyTorch meshes the dim is gathered first.
* Other reductions must see whole rows: the reduced dims are unsharded first
  (and partials reduced), so results are exact.
* Dims that are not reduced keep their shards (compressed if ``keepdim=False``).
"""
from __future__ import annotations

from hyper_parallel.dtensor.mesh_semantics import semantics_of
from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy
from hyper_parallel.dispatch.rules.elementwise import NONLINEAR, elementwise_strategy
from hyper_parallel.dispatch.rules.extremum_dim import max_min_dim_strategy
from hyper_parallel.distributed import differentiable
import torch

LINEAR = ("sum", "mean", "nansum")
# reductions that commute with a reduction over the ranks: the reduce op of their Partial result
PARTIAL_OP = {"sum": "sum", "mean": "sum", "nansum": "sum", "prod": "prod", "all": "all", "any": "any"}


def _parse(call):
    """(reduced dims as a sorted tuple, keepdim) from the call's arguments."""
    nd = len(call.shapes[0])
    args, kw = call.args, call.kwargs
    dim = kw.get("dim", kw.get("axis"))
    keepdim = kw.get("keepdim", False)
    name = call.name
    rest = list(args[1:])
    if name in ("norm",):
        # norm(input, p='fro', dim=None, keepdim=False, dtype=None)
        if len(rest) >= 2 and dim is None:
            dim = rest[1]
        if len(rest) >= 3:
            keepdim = rest[2]
    elif name in ("vector_norm", "linalg_vector_norm"):
        if len(rest) >= 2 and dim is None:
            dim = rest[1]
        if len(rest) >= 3:
            keepdim = rest[2]
    elif name in ("var", "std") and rest:
        if dim is None and not isinstance(rest[0], bool):
            dim = rest[0]
        if len(rest) >= 3 and isinstance(rest[-1], bool):
            keepdim = rest[-1]
    elif name == "logsumexp":
        dim = rest[0] if rest and dim is None else dim
        if len(rest) >= 2:
            keepdim = rest[1]
    else:
        if rest and dim is None and not _is_dtype(rest[0]):
            dim = rest[0]
        if len(rest) >= 2 and isinstance(rest[1], bool):
            keepdim = rest[1]
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0 and name not in ("sum", "mean")):
        dims = tuple(range(nd))
    elif isinstance(dim, (list, tuple)):
        dims = tuple(sorted(d % nd for d in dim)) if nd else ()
        if not dims:
            dims = tuple(range(nd))
    else:
        dims = (dim % nd,) if nd else ()
    return dims, bool(keepdim)


def _is_dtype(obj):
    return type(obj).__name__ == "dtype"


class ReductionRule(DistributedOp):
    float_args_matter = True  # norm's p picks the local implementation

    def strategy(self, call):
        name = call.name
        if name in ("max", "min") and len(call.layouts) == 2:
            # binary max/min(a, b) is elementwise maximum/minimum
            return elementwise_strategy(call, NONLINEAR)
        lay, shape = call.layouts[0], call.shapes[0]
        dims, keepdim = _parse(call)
        nd = len(shape)
        if name in ("amax", "amin") or (name in ("max", "min") and len(call.args) == 1 and "dim" not in call.kwargs):
            return _extremum_strategy(call, lay, dims, keepdim)
        linear = name in LINEAR
        sharded_reduced = [d for d in dims if lay.dim_map[d]]
        if name in ("max", "min") and len(dims) == 1 and sharded_reduced \
                and semantics_of(call.mesh).max_min_dim_partial:
            # max(dim)/min(dim), HyperParallel: values Partial(max/min), global indices
            return max_min_dim_strategy(call, lay.without_partial() if lay.has_partial() else lay, dims[0],
                                        keepdim)
        op = PARTIAL_OP.get(name)
        if op is not None:
            # inputs pending another reduction are reduced first; then every sharded reduced dim's
            # mesh dims become pending ``op``
            in_layout = lay if all(p in (None, op) for p in lay.partial) else lay.without_partial()
            partial = list(in_layout.partial)
            for t in sharded_reduced:
                for md in lay.dim_map[t]:
                    partial[md] = op
        else:
            dm = tuple(() if t in dims else m for t, m in enumerate(lay.dim_map))
            in_layout = lay.with_dim_map(dm, (None,) * len(lay.mesh_shape))
            partial = [None] * len(lay.mesh_shape)
        # output dim map
        out_dm = []
        for t in range(nd):
            if t in dims:
                if keepdim:
                    out_dm.append(())
            else:
                out_dm.append(in_layout.dim_map[t])
        out = lay.with_dim_map(out_dm, partial)
        ins = [in_layout]
        local_fn = None
        if name in ("norm", "vector_norm", "linalg_vector_norm") and not linear:
            p = _norm_ord(call)
            sharded_md = [md for t in dims for md in lay.dim_map[t]]
            if p is not None and sharded_md and not lay.has_partial():
                # exact and cheap: all-reduce the local powered sums, no gather
                ins = [lay]
                out = lay.with_dim_map([m for t, m in enumerate(lay.dim_map) if t not in dims or keepdim]
                                       if not keepdim else
                                       [() if t in dims else m for t, m in enumerate(lay.dim_map)],
                                       (None,) * len(lay.mesh_shape))
                local_fn = _sharded_norm_fn(p, list(dims), keepdim, [call.mesh.get_comm_group(md) for md in sharded_md])
                return Strategy(ins + list(call.layouts[1:]), out, local_fn=local_fn)
        if name == "mean" and sharded_reduced:
            count = 1
            for d in dims:
                count *= shape[d]
            ops = torch
            dtype = call.kwargs.get("dtype")
            dims_arg = list(dims)

            def local_fn(local, *args, **kwargs):
                return ops.sum(local, dim=dims_arg, keepdim=keepdim, dtype=dtype) / count
        n_out = 2 if name in ("max", "min", "aminmax", "var_mean", "std_mean") and (
            name in ("aminmax", "var_mean", "std_mean") or len(call.args) > 1 or "dim" in call.kwargs) else 1
        if n_out == 2:
            out = (out, out)
        ins += [l for l in call.layouts[1:]]
        return Strategy(ins, out, local_fn=local_fn)


def _extremum_strategy(call, lay, dims, keepdim):
    """max()/min() and amax/amin over any dims: reduce locally, ``Partial(max/min)`` over sharded dims.

    As in torch's DTensor: ``x.max()`` of a sharded tensor moves one value per rank
    (when it is reduced later), not the tensor. ``max(dim)``/``min(dim)`` also return
    indices, which must be global: those keep the generic rule (the dim is unsharded).
    """
    op = "max" if call.name in ("max", "amax") else "min"
    in_layout = lay
    if any(p not in (None, op) for p in lay.partial):
        in_layout = lay.without_partial()
    partial = list(in_layout.partial)
    for t in dims:
        for md in in_layout.dim_map[t]:
            partial[md] = op
    out_dm = [() if t in dims else m for t, m in enumerate(in_layout.dim_map) if keepdim or t not in dims]
    out = in_layout.with_dim_map(out_dm, partial)
    sharded = any(in_layout.dim_map[t] for t in dims)
    local_fn = _empty_safe_extremum(call.func, op, list(dims), keepdim) if sharded else None
    return Strategy([in_layout] + list(call.layouts[1:]), out, local_fn=local_fn)


def _empty_safe_extremum(func, extremum, dims, keepdim):
    """``func`` on the local shard; an empty shard gives the identity (-inf / +inf, or the integer bound)."""
    ops = torch

    def local_fn(local, *args, **kwargs):
        if all(local.shape[d] for d in dims) and local.numel():
            return func(local, *args, **kwargs)
        shape = [1 if d in dims else s for d, s in enumerate(local.shape) if keepdim or d not in dims]
        if local.is_floating_point():
            fill = float("-inf") if extremum == "max" else float("inf")
        else:
            info = ops.iinfo(local.dtype) if local.dtype != ops.bool else None
            if info is None:
                fill = extremum != "max"
            else:
                fill = info.min if extremum == "max" else info.max
        out = ops.full(shape, fill, dtype=local.dtype, device=local.device)
        return out + local.sum() * 0 if local.requires_grad else out  # keep the graph connected, as on other ranks
    return local_fn


def _norm_ord(call):
    if call.name in ("vector_norm", "linalg_vector_norm"):
        p = call.args[1] if len(call.args) > 1 else call.kwargs.get("ord", 2)
    else:
        p = call.args[1] if len(call.args) > 1 else call.kwargs.get("p", "fro")
    if p in ("fro", None):
        return 2.0
    if isinstance(p, (int, float)) and p > 0:
        return float(p)
    return None


def _sharded_norm_fn(order, dims, keepdim, groups):
    ops, AllReduce = torch, differentiable.AllReduce

    def local_fn(shard, *args, **kwargs):
        ax = shard.abs()
        if order == float("inf"):
            # an empty shard contributes 0, through the graph so every rank's result requires grad alike
            local = ops.amax(ax, dim=dims, keepdim=keepdim) if shard.numel() else \
                ops.sum(ax, dim=dims, keepdim=keepdim) * 0
            op = "max"
        else:
            # the shard's norm by torch's kernel, ** p (torch's _NormPartial; see ForeachNormRule)
            local = ops.sum(ax, dim=dims, keepdim=keepdim) if order == 1 else \
                ops.linalg.vector_norm(shard, order, dim=dims, keepdim=keepdim) ** order
            op = "sum"
        for g in groups:
            local = AllReduce.apply(local, g, op)
        if order in (1.0, float("inf")):
            return local
        return local.sqrt() if order == 2 else local.pow(1.0 / order)
    return local_fn


def register_all():
    for n in ("sum", "mean", "nansum", "max", "min", "amax", "amin", "argmax", "argmin", "prod", "norm",
              "vector_norm", "linalg_vector_norm", "any", "all", "var", "std", "logsumexp", "aminmax", "count_nonzero", "nanmean",
              "var_mean", "std_mean"):
        rule = ReductionRule(n)
        if n in ("max", "min"):
            rule.mesh_semantics_matter = True  # max(dim)/min(dim): Partial values on HyperParallel meshes only

