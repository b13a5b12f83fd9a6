"""Scatter-like and membership ops: scatter / scatter_add / scatter_reduce, index_add, masked_scatter, isin.

* ``scatter`` / ``scatter_add`` / ``scatter_reduce`` (and ``index_add``): the
  scatter dim is unsharded in the input, the index and the source; every other
  dim keeps the input's shard where the index and source cover the whole dim
  (same size), and is unsharded otherwise. Partial inputs are reduced first.
  The output is laid out like the (target) input.
* ``masked_scatter``: the source is consumed in row-major order of the *global*
  mask, so input, mask and source are replicated and so is the output.
* ``isin``: elementwise in ``elements`` (its shards are kept), ``test_elements``
  replicated; the boolean output is laid out like ``elements``.

For these ops a plain (non-DTensor) tensor argument, such as an integer index or
a boolean mask, is taken as replicated (HyperParallel programs pass them so).
"""
from __future__ import annotations

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, PLAIN_AS_REPLICATED
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt, bind_args as _bind

_SCATTER_NAMES = {
    "scatter": ("input", "dim", "index", "src"),
    "scatter_": ("input", "dim", "index", "src"),
    "scatter_add": ("input", "dim", "index", "src"),
    "scatter_add_": ("input", "dim", "index", "src"),
    "scatter_reduce": ("input", "dim", "index", "src", "reduce"),
    "scatter_reduce_": ("input", "dim", "index", "src", "reduce"),
    "index_add": ("input", "dim", "index", "source"),
    "index_add_": ("input", "dim", "index", "source"),
}


def _dt_roles(call, names):
    """Argument name of every DTensor input, in the dispatcher's order."""
    v = _bind(call.args, call.kwargs, names)
    roles = []
    for i, a in enumerate(call.args):
        if _is_dt(a):
            roles.append(names[i] if i < len(names) else f"arg{i}")
    for k, a in call.kwargs.items():
        if _is_dt(a):
            roles.append(k)
    return v, roles


class ScatterRule(DistributedOp):
    """scatter / scatter_add / scatter_reduce / index_add, functional and in place (see module docstring)."""

    float_args_matter = False

    def strategy(self, call):
        names = _SCATTER_NAMES[call.name]
        v, roles = _dt_roles(call, names)
        if not roles or roles[0] != "input":
            raise NotImplementedError(f"{call.name}: the input (first argument) must be a DTensor")
        lay = dict(zip(roles, call.layouts))
        shp = dict(zip(roles, call.shapes))
        x_lay, x_shape = lay["input"], shp["input"]
        nd = len(x_shape)
        dim = v["dim"] % nd if nd else 0
        index_add = call.name.startswith("index_add")
        others = [r for r in roles if r != "input"]
        dm = []
        for t in range(nd):
            m = x_lay.dim_map[t]
            if t == dim:
                m = ()
            elif m:
                for r in others:
                    if r == "index" and index_add:
                        continue  # index_add's index is 1-d along dim
                    s = shp[r]
                    if len(s) != nd or s[t] != x_shape[t]:
                        m = ()
            dm.append(tuple(m))
        inplace = call.name.endswith("_")
        x_tgt = x_lay.with_dim_map(dm, (None,) * x_lay.mesh_ndim)
        if inplace and x_tgt != x_lay:
            raise RuntimeError(f"{call.name}: in place on a DTensor with placements {x_lay.placements}; the scatter dim "
                               f"{dim} must be unsharded and the target not Partial (redistribute it first)")
        targets = []
        for r in roles:
            if r == "input":
                targets.append(x_tgt)
            elif r == "index" and index_add:
                targets.append(lay[r].replicated())
            else:
                targets.append(lay[r].with_dim_map(dm if len(shp[r]) == nd else ((),) * len(shp[r]),
                                                   (None,) * x_lay.mesh_ndim))
        return Strategy(targets, x_tgt)


class ReplicatedRule(DistributedOp):
    """Every DTensor input replicated (partials reduced); the output replicated (masked_scatter)."""

    float_args_matter = False

    def strategy(self, call):
        from hyper_parallel.dispatch.rules.base import meta_run
        targets = [l.replicated(len(s)) for l, s in zip(call.layouts, call.shapes)]
        out = meta_run(call.func, call.args, call.kwargs)
        return Strategy(targets, call.layouts[0].replicated(out.dim()))


class IsinRule(DistributedOp):
    """isin(elements, test_elements): ``elements`` keeps its shards, ``test_elements`` replicated."""

    float_args_matter = False

    def strategy(self, call):
        names = ("elements", "test_elements")
        v, roles = _dt_roles(call, names)
        targets = []
        out = None
        for r, l, s in zip(roles, call.layouts, call.shapes):
            if r == "elements":
                t = l.without_partial() if l.has_partial() else l
                out = t
            else:
                t = l.replicated(len(s))
            targets.append(t)
        if out is None:  # a scalar element tested against a DTensor: a 0-d replicated result
            out = call.layouts[0].replicated(0)
        return Strategy(targets, out)


def register_all():
    PLAIN_AS_REPLICATED.update(list(_SCATTER_NAMES) + ["masked_scatter", "isin"])
    for n in _SCATTER_NAMES:
        ScatterRule(n)
    ReplicatedRule("masked_scatter")
    IsinRule("isin")


__all__ = ["register_all", "ScatterRule", "ReplicatedRule", "IsinRule"]
