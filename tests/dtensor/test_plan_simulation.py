"""Every redistribution plan on the (2, 2, 2) mesh, checked by simulating all 8 ranks in one process.

The multi-process parity test runs every (src, dst) pair on the (4,) and (2, 2) meshes but only a
seeded sample on (2, 2, 2), because 8 real ranks on 2 cores are slow. This pure-math test
covers the rest: for EVERY pair of placements from {R, S0, S1, P} (sources) and {R, S0, S1}
(targets) on (2, 2, 2), for an even and an uneven shape, it executes the planner's steps on the
local pieces of all ranks (gathers concatenate the group's pieces, reductions sum them,
splits/all_to_alls cut with the step's torch.chunk sizes) and checks that every rank ends up
with exactly its ``torch.chunk`` piece of the tensor under the target layout.
"""
import itertools

import torch

from hyper_parallel import Partial, Replicate, Shard
from hyper_parallel.dtensor import redistribute_plan as rp
from hyper_parallel.core.dtensor.layout import Layout, coordinate_of

MESH = (2, 2, 2)
N = 8


def _piece(full, layout, coord):
    shape, off = layout.local_shape_and_offset(tuple(full.shape), coord=coord)
    out = full
    for d, (o, s) in enumerate(zip(off, shape)):
        out = out.narrow(d, o, s)
    return out


def _group(i, d):
    c = coordinate_of(i, MESH)
    members = []
    for k in range(MESH[d]):
        cc = list(c)
        cc[d] = k
        members.append(sum(x * m for x, m in zip(cc, (4, 2, 1))))
    return members


def _initial(full, layout):
    locs = []
    for i in range(N):
        c = coordinate_of(i, MESH)
        base = layout.without_partial()
        loc = _piece(full, base, c).clone()
        for d, op in enumerate(layout.partial):
            if op == "sum":  # uneven positive weights that sum to one over the group
                loc = loc * ((c[d] + 1) * 2.0 / (MESH[d] * (MESH[d] + 1)))
        locs.append(loc)
    return locs


def _cut(t, dim, sizes, idx):
    return t.narrow(dim, sum(sizes[:idx]), sizes[idx])


def _run(locs, plan):
    for st in plan.steps:
        d, t = st.mesh_dim, st.tensor_dim
        new = []
        for i in range(N):
            g = _group(i, d)
            me = coordinate_of(i, MESH)[d]
            if st.kind == "relabel":
                new.append(locs[i])
            elif st.kind == rp.ALL_GATHER:
                new.append(torch.cat([locs[j] for j in g], dim=t))
            elif st.kind == rp.SPLIT:
                new.append(_cut(locs[i], t, st.sizes[i], me))
            elif st.kind == rp.ALL_REDUCE:
                new.append(sum(locs[j] for j in g))
            elif st.kind == rp.REDUCE_SCATTER:
                new.append(_cut(sum(locs[j] for j in g), t, st.sizes[i], me))
            elif st.kind == rp.ALL_TO_ALL:
                split_sizes, _ = st.sizes[i]
                parts = []
                for j in g:
                    sj, _ = st.sizes[j]
                    parts.append(_cut(locs[j], st.dst_dim, sj, me))
                assert all(p.shape[st.dst_dim] == split_sizes[me] for p in parts)
                new.append(torch.cat(parts, dim=t))
            elif st.kind == rp.TO_PARTIAL:
                new.append(locs[i] if me == 0 else torch.zeros_like(locs[i]))
            else:
                raise AssertionError(st.kind)
        locs = new
    return locs


def _reduce_partials(locs, layout):
    out = list(locs)
    for d, op in enumerate(layout.partial):
        if op is not None:
            out = [sum(out[j] for j in _group(i, d)) for i in range(N)]
    return out


def test_every_pair_on_2x2x2_mesh():
    base = Layout(MESH, ("pp", "dp", "tp"))
    srcs = list(itertools.product((Replicate(), Shard(0), Shard(1), Partial()), repeat=3))
    dsts = list(itertools.product((Replicate(), Shard(0), Shard(1)), repeat=3)) + [
        (Partial(), Replicate(), Shard(0)), (Replicate(), Shard(1), Partial())]
    aliases = [base(("tp", "pp"), "dp"), base("None", ("tp", "dp", "pp")), base(("tp", "dp", "pp"), "None")]
    checked = 0
    for shape in ((8, 8), (3, 5)):
        full = torch.arange(float(shape[0] * shape[1]), dtype=torch.float64).view(shape) + 1
        src_layouts = [base.with_placements(s, 2) for s in srcs] + aliases
        dst_layouts = [base.with_placements(d, 2) for d in dsts] + aliases
        for src, dst in itertools.product(src_layouts, dst_layouts):
            plan = rp.plan(src, dst, shape, 8)
            out = _reduce_partials(_run(_initial(full, src), plan), dst)
            for i in range(N):
                want = _piece(full, dst.without_partial(), coordinate_of(i, MESH))
                torch.testing.assert_close(out[i], want, rtol=1e-12, atol=1e-12,
                                           msg=lambda m: f"{src} -> {dst} shape {shape} rank {i}: {m}")
            # no plan detours: at most one communicating move per mesh dim that changes, plus reorders
            assert sum(1 for s in plan.steps if s.is_comm) <= 2 * len(MESH), plan
            checked += 1
    assert checked == 2 * (len(srcs) + 3) * (len(dsts) + 3)
