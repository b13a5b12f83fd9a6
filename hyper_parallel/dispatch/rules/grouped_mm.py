"""``torch._grouped_mm(mat_a, mat_b, offs=...)`` on DTensors: grouped (expert) matmul, computed locally.

The MoE form: ``mat_a`` ``[T, K]`` rows grouped by expert, ``mat_b`` ``[G, K, N]`` (one matrix per expert),
``offs`` ``[G]`` cumulative row ends (global, replicated). Per mesh dim the layouts below run with no
communication (anything else is made replicated on that mesh dim first):

=================================  =======================  =================================================
mat_a                              mat_b                    output
=================================  =======================  =================================================
Replicate                          Shard(0) (experts)       Partial(sum): each rank computes the rows of its
                                                            experts, zeros elsewhere (expert-sharded weights)
Shard(0) (rows)                    Replicate / Shard(0)     Shard(0): each rank its rows (offsets shifted)
Replicate                          Shard(2) (out features)  Shard(1) (column-parallel)
Shard(1) (in features)             Shard(1)                 Partial(sum) (row-parallel)
Partial                            Replicate                Partial (linear)
Replicate                          Partial                  Partial (linear)
=================================  =======================  =================================================

The local kernel is ``grouped_mm_kernels.grouped_mm_local``: torch's
``_grouped_mm`` where it runs, an exact per-group loop elsewhere (CPU, float64), over the rank's rows
(from global row ``r0``) and experts (from global expert ``g0``) with the global offsets.
"""
from __future__ import annotations

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, PLAIN_AS_REPLICATED
from hyper_parallel.dispatch.rules.base import bind_args as _bind
from hyper_parallel.dispatch.rules.grouped_mm_kernels import grouped_mm_local

_NAMES = ("mat_a", "mat_b", "offs", "bias", "out_dtype")


def _state(layout, mesh_dim):
    """('S', tensor dim) / ('P', op) / ('R', None) of ``layout`` on mesh dim ``mesh_dim``."""
    if layout.partial[mesh_dim] is not None:
        return "P", layout.partial[mesh_dim]
    t = layout.tensor_dim_of(mesh_dim)
    return ("S", t) if t is not None else ("R", None)


class GroupedMmRule(DistributedOp):
    """``_grouped_mm`` (see the module docstring)."""

    float_args_matter = False

    def strategy(self, call):
        v = _bind(call.args, call.kwargs, _NAMES)
        a, b, offs = v.get("mat_a"), v.get("mat_b"), v.get("offs")
        dts = call.dtensor_args
        ia = next((i for i, d in enumerate(dts) if d is a), None)
        ib = next((i for i, d in enumerate(dts) if d is b), None)
        if ia is None or ib is None or offs is None or v.get("bias") is not None or \
                len(call.shapes[ia]) != 2 or len(call.shapes[ib]) != 3:
            raise NotImplementedError(f"{call.name}: on DTensors only the MoE form is supported: mat_a [T, K] and "
                                      f"mat_b [G, K, N] DTensors with offs (cumulative row ends), no bias")
        la, lb = call.layouts[ia], call.layouts[ib]
        mesh_shape = la.mesh_shape
        ta = [list(m) for m in la.dim_map]
        tb = [list(m) for m in lb.dim_map]
        pa, pb = list(la.partial), list(lb.partial)
        out_dm = [[], []]
        out_p = [None] * len(mesh_shape)
        for d, k in enumerate(mesh_shape):
            if k == 1:
                continue
            sa, sb = _state(la, d), _state(lb, d)
            case = (sa[0], sa[1] if sa[0] == "S" else None, sb[0], sb[1] if sb[0] == "S" else None)
            if case == ("R", None, "R", None):
                continue
            if case == ("S", 0, "S", 0):  # rows and experts on one mesh dim: gather the rows
                ta[0].remove(d)
                case = ("R", None, "S", 0)
            if case == ("R", None, "S", 0) or case == ("S", 1, "S", 1):
                out_p[d] = "sum"
            elif case == ("S", 0, "R", None):
                out_dm[0].append(d)
            elif case == ("R", None, "S", 2):
                out_dm[1].append(d)
            elif sa[0] == "P" and sb[0] == "R" and sa[1] == "sum":
                out_p[d] = "sum"
            elif sb[0] == "P" and sa[0] == "R" and sb[1] == "sum":
                out_p[d] = "sum"
            else:  # anything else: replicate both operands on this mesh dim
                for dm in (ta, tb):
                    for m in dm:
                        if d in m:
                            m.remove(d)
                pa[d] = pb[d] = None
        targets = list(call.layouts)
        targets[ia] = la.with_dim_map(tuple(tuple(m) for m in ta), tuple(pa))
        targets[ib] = lb.with_dim_map(tuple(tuple(m) for m in tb), tuple(pb))
        for i, l in enumerate(call.layouts):
            if i not in (ia, ib):
                targets[i] = l.replicated()
        out = la.with_dim_map((tuple(out_dm[0]), tuple(out_dm[1])), tuple(out_p))
        coord = call.mesh.get_coordinate()
        r0 = g0 = 0
        if coord is not None:
            r0 = targets[ia].local_shape_and_offset(call.shapes[ia], coord=coord)[1][0]
            g0 = targets[ib].local_shape_and_offset(call.shapes[ib], coord=coord)[1][0]
        return Strategy(targets, out, local_fn=_local(r0, g0))


def _local(row_offset, group_offset):
    def fn(*args, **kwargs):
        v = _bind(args, kwargs, _NAMES)
        out = grouped_mm_local(v["mat_a"], v["mat_b"], v["offs"], row_offset, group_offset)
        dt = v.get("out_dtype")
        return out if dt is None else out.to(dt)
    return fn


def register_all():
    GroupedMmRule("_grouped_mm")
    PLAIN_AS_REPLICATED.add("_grouped_mm")   # offs is usually a plain tensor next to the DTensor operands


__all__ = ["GroupedMmRule", "register_all"]
