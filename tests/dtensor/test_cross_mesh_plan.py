"""Cross-mesh planner on pure math: every placement pair between seven meshes, all ranks simulated.

Meshes (8 ranks): (2, 4), (4, 2) and (8,) over ranks 0..7; ranks [0, 1, 2, 3] as (4,) and (2, 2);
ranks [4, 5, 6, 7] as (4,) and (2, 2). For EVERY ordered pair of different meshes and EVERY pair
of non-partial placements (R, S0, S1 per mesh dim) of an even (8, 12) and an uneven (5, 3) tensor,
the per-rank programs of the plan are executed on numpy arrays exactly as the executor does
(pack each message, unpack it, copy locally), and:

* every target rank ends with exactly its ``torch.chunk`` piece (checked against slices of the
  global array, the slices being computed here from chunk rules, independently of the planner);
* every element of every target shard is written exactly once (no element crosses twice);
* a sender only sends data it holds; a local copy only happens on a rank that holds the data;
* the plan's bytes equal the minimum, computed here: per target rank, the bytes it needs minus
  the bytes it already holds as a source rank;
* the backward plan is the same check in reverse.

Partial sources and targets: the plan reduces first on the source mesh (to a non-partial layout
that minimises the total cost) and makes partial targets locally; checked on a sweep too.
"""
import itertools

import numpy as np
import pytest
import torch

from hyper_parallel import Partial, Replicate, Shard
from hyper_parallel.dtensor import cross_mesh_plan as cmp
from hyper_parallel.dtensor import redistribute_plan as rp
from hyper_parallel.core.dtensor.layout import Layout

MESHES = {
    "2x4": ((2, 4), tuple(range(8))),
    "4x2": ((4, 2), tuple(range(8))),
    "8": ((8,), tuple(range(8))),
    "a4": ((4,), (0, 1, 2, 3)),
    "a2x2": ((2, 2), (0, 1, 2, 3)),
    "b4": ((4,), (4, 5, 6, 7)),
    "b2x2": ((2, 2), (4, 5, 6, 7)),
}
SHAPES = [(8, 12), (5, 3)]
ITEM = 4


def _base(name):
    shape, ranks = MESHES[name]
    return Layout(shape, None, ranks)


def _placements(ndim_mesh, partial=False):
    opts = [Replicate(), Shard(0), Shard(1)] + ([Partial()] if partial else [])
    return list(itertools.product(opts, repeat=ndim_mesh))


def _chunk_box(gshape, layout, rank):
    """(offset, shape) of ``rank`` from torch.chunk on index ranges (independent of the planner)."""
    idx = layout.rank_list.index(rank)
    coord = np.unravel_index(idx, layout.mesh_shape)
    ranges = [torch.arange(n) for n in gshape]
    for t, dims in enumerate(layout.dim_map):
        for d in dims:
            pieces = torch.chunk(ranges[t], layout.mesh_shape[d]) if len(ranges[t]) else ()
            c = int(coord[d])
            ranges[t] = pieces[c] if c < len(pieces) else ranges[t][:0]
    off = tuple(int(r[0]) if len(r) else 0 for r in ranges)
    return off, tuple(len(r) for r in ranges)


def _sl(start, shape):
    return tuple(slice(s, s + n) for s, n in zip(start, shape))


def _simulate(p2p, full):
    """Run every rank's program on numpy arrays; return {rank: output} (target ranks)."""
    src, dst = p2p.src, p2p.dst
    gshape = full.shape
    src_box = {r: _chunk_box(gshape, src, r) for r in src.rank_list}
    dst_box = {r: _chunk_box(gshape, dst, r) for r in dst.rank_list}
    inputs = {r: full[_sl(*src_box[r])] for r in src.rank_list}
    ranks = sorted(set(src.rank_list) | set(dst.rank_list))
    progs = {r: p2p.program(r) for r in ranks}
    wire = {}
    for r, prog in progs.items():
        assert prog.in_shape == (src_box[r][1] if r in src_box else None)
        assert prog.out_shape == (dst_box[r][1] if r in dst_box else None)
        for peer, pieces in prog.sends:
            parts = []
            for st, sh in pieces:
                assert all(0 <= s and s + n <= m for s, n, m in zip(st, sh, prog.in_shape)), "sends data it lacks"
                parts.append(inputs[r][_sl(st, sh)].reshape(-1))
            assert (r, peer) not in wire, "two messages for one pair"
            wire[(r, peer)] = np.concatenate(parts)
    outs, bytes_moved = {}, 0
    for r, prog in progs.items():
        if prog.out_shape is None:
            assert not prog.recvs and not prog.copies
            continue
        out = np.full(prog.out_shape, -1, dtype=full.dtype)
        count = np.zeros(prog.out_shape, dtype=np.int64)
        for ist, ost, sh in prog.copies:
            assert all(0 <= s and s + n <= m for s, n, m in zip(ist, sh, prog.in_shape)), "copies data it lacks"
            out[_sl(ost, sh)] = inputs[r][_sl(ist, sh)]
            count[_sl(ost, sh)] += 1
        for peer, pieces in prog.recvs:
            buf = wire.pop((peer, r))
            bytes_moved += buf.size * ITEM
            pos = 0
            for st, sh in pieces:
                n = int(np.prod(sh))
                out[_sl(st, sh)] = buf[pos:pos + n].reshape(sh)
                count[_sl(st, sh)] += 1
                pos += n
            assert pos == buf.size
        assert (count == 1).all(), f"rank {r}: elements written {np.unique(count)} times"
        outs[r] = out
    assert not wire, f"messages nobody receives: {list(wire)}"
    for r, (off, shape) in dst_box.items():
        np.testing.assert_array_equal(outs[r], full[_sl(off, shape)])
    return bytes_moved


def _min_bytes(src, dst, gshape):
    total = 0
    for r in dst.rank_list:
        off, shape = _chunk_box(gshape, dst, r)
        need = int(np.prod(shape))
        if r in src.rank_list and need:
            so, ss = _chunk_box(gshape, src, r)
            over = 1
            for a, n, b, m in zip(off, shape, so, ss):
                over *= max(0, min(a + n, b + m) - max(a, b))
            need -= over
        total += need
    return total * ITEM


def _check_pair(a, b, gshape, full):
    plan = cmp.cross_mesh_plan(a, b, gshape, ITEM)
    assert plan.pre_steps is None and plan.post_steps is None
    moved = _simulate(plan.moves, full)
    assert moved == plan.moves.total_bytes == _min_bytes(a, b, gshape), (a, b, gshape)
    assert sum(plan.moves.bytes_sent(r) for r in set(a.rank_list) | set(b.rank_list)) == moved
    back = _simulate(plan.backward, full)
    assert back == plan.backward.total_bytes == _min_bytes(b, a, gshape)


@pytest.mark.parametrize("gshape", SHAPES)
def test_every_placement_pair_between_meshes(gshape):
    full = np.arange(int(np.prod(gshape)), dtype=np.int64).reshape(gshape)
    n = 0
    for ma, mb in itertools.permutations(MESHES, 2):
        base_a, base_b = _base(ma), _base(mb)
        for pa in _placements(base_a.mesh_ndim):
            a = base_a.with_placements(pa, 2)
            for pb in _placements(base_b.mesh_ndim):
                _check_pair(a, base_b.with_placements(pb, 2), gshape, full)
                n += 1
    assert n == 1674


def test_3d_tensor_from_a_3d_mesh():
    """A 3-D tensor from (2, 2, 2) to (8,) (every pair) and to (4, 2) (a seeded sample of 400 of the
    4,096 pairs): nested shards of one tensor dim over several mesh dims, uneven extents."""
    gshape = (4, 6, 3)
    full = np.arange(72, dtype=np.int64).reshape(gshape)
    a3 = Layout((2, 2, 2), None, tuple(range(8)))
    opts = [Replicate(), Shard(0), Shard(1), Shard(2)]
    pairs = [(pa, "8", pb) for pa in itertools.product(opts, repeat=3) for pb in itertools.product(opts, repeat=1)]
    rest = [(pa, "4x2", pb) for pa in itertools.product(opts, repeat=3) for pb in itertools.product(opts, repeat=2)]
    rng = np.random.default_rng(0)
    pairs += [rest[i] for i in rng.choice(len(rest), 400, replace=False)]
    for pa, name, pb in pairs:
        _check_pair(a3.with_placements(pa, 3), _base(name).with_placements(pb, 3), gshape, full)


def test_0d_and_1d_tensors():
    """A scalar (one element, held by every rank: moved only to target ranks off the source mesh)
    and a 1-d tensor of 3 elements over 4 and 8 ranks (empty pieces)."""
    for gshape in ((), (3,), (13,)):
        full = np.arange(int(np.prod(gshape)), dtype=np.int64).reshape(gshape)
        for ma, mb in itertools.permutations(MESHES, 2):
            base_a, base_b = _base(ma), _base(mb)
            opts = [Replicate()] + ([Shard(0)] if gshape else [])
            for pa in itertools.product(opts, repeat=base_a.mesh_ndim):
                for pb in itertools.product(opts, repeat=base_b.mesh_ndim):
                    _check_pair(base_a.with_placements(pa, len(gshape)), base_b.with_placements(pb, len(gshape)),
                                gshape, full)


def test_partial_sources_reduce_first_and_partial_targets_are_local():
    gshape = (8, 12)
    for ma, mb in [("2x4", "4x2"), ("a2x2", "b4"), ("8", "a2x2"), ("b2x2", "2x4")]:
        base_a, base_b = _base(ma), _base(mb)
        for pa in _placements(base_a.mesh_ndim, partial=True):
            a = base_a.with_placements(pa, 2)
            for pb in _placements(base_b.mesh_ndim, partial=True):
                b = base_b.with_placements(pb, 2)
                plan = cmp.cross_mesh_plan(a, b, gshape, ITEM)
                assert not plan.pre_layout.has_partial()
                if a.has_partial():
                    assert plan.reduces_first
                    assert [s.kind for s in plan.pre_steps.steps] == \
                        [s.kind for s in rp.plan(a, plan.pre_layout, gshape, ITEM).steps]
                    # the chosen reduction is no worse than all-reducing to Replicate
                    naive = cmp.p2p_plan(a.without_partial(), b.without_partial(), gshape, ITEM).max_bytes() + max(
                        rp.plan(a, a.without_partial(), gshape, ITEM).bytes_for_rank(i) for i in range(len(a.rank_list)))
                    assert plan.cost() <= naive
                    assert "reduce on the source mesh" in plan.describe()
                else:
                    assert plan.pre_steps is None and plan.pre_layout == a
                if b.has_partial():
                    assert all(s.kind in (rp.TO_PARTIAL, "relabel") for s in plan.post_steps.steps)
                else:
                    assert plan.post_steps is None
                assert plan.moves.dst == b.without_partial()
                assert plan.moves.total_bytes == _min_bytes(plan.pre_layout, b.without_partial(), gshape)


def test_replicas_share_the_sending_and_local_copies_are_preferred():
    gshape = (8, 12)
    a = _base("a4").with_placements([Replicate()], 2)
    b = _base("b4").with_placements([Shard(0)], 2)
    p = cmp.p2p_plan(a, b, gshape, ITEM)
    # four receivers, four holders: each holder sends one quarter
    assert sorted(p.messages()) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert all(p.bytes_sent(r) == 2 * 12 * ITEM for r in range(4))
    # more holders than receivers: each receiver's piece comes in parts from several replicas
    b2 = Layout((2,), None, (4, 5)).with_placements([Replicate()], 2)
    p = cmp.p2p_plan(a, b2, gshape, ITEM)
    assert sorted(p.messages()) == [(0, 4), (1, 4), (2, 5), (3, 5)]
    assert all(p.bytes_sent(r) == 4 * 12 * ITEM for r in range(4)) and p.total_bytes == 2 * 8 * 12 * ITEM
    one = Layout((1,), None, (6,)).with_placements([Shard(1)], 2)
    p = cmp.p2p_plan(a, one, (5, 3), ITEM)  # 5 rows from 4 replicas: 2, 1, 1, 1 rows
    assert [p.bytes_sent(r) for r in range(4)] == [6 * ITEM, 3 * ITEM, 3 * ITEM, 3 * ITEM]
    # same ranks and shape, other dim names: local copies only
    named = Layout((2, 4), ("x", "y"), tuple(range(8))).with_placements([Shard(0), Shard(1)], 2)
    p = cmp.p2p_plan(_base("2x4").with_placements([Shard(0), Shard(1)], 2), named, gshape, ITEM)
    assert p.total_bytes == 0 and len(p.transfers) == 8
    # same ranks, other shape, replicated both sides: nothing moves
    r1 = _base("2x4").with_placements([Replicate(), Replicate()], 2)
    r2 = _base("4x2").with_placements([Replicate(), Shard(1)], 2)
    p = cmp.p2p_plan(r1, r2, gshape, ITEM)
    assert p.total_bytes == 0 and not p.messages() and all(t.is_local for t in p.transfers)
    # (8,) Shard(0) -> (4, 2) [Shard(0), Replicate]: ranks that keep their rows copy them locally
    s8 = _base("8").with_placements([Shard(0)], 2)
    s42 = _base("4x2").with_placements([Shard(0), Replicate()], 2)
    p = cmp.p2p_plan(s8, s42, gshape, ITEM)
    assert p.total_bytes == _min_bytes(s8, s42, gshape) == 8 * 12 * ITEM
    assert all(p.sends(r) == 1 and p.recvs(r) == 1 for r in range(8))


def test_errors():
    a = _base("a4").with_placements([Shard(0)], 2)
    b = _base("b4").with_placements([Shard(0)], 3)
    with pytest.raises(ValueError, match=r"2-d tensor and the target layout a 3-d one"):
        cmp.cross_mesh_plan(a, b, (8, 12), ITEM)
    with pytest.raises(ValueError, match=r"global shape is \(8, 12, 2\)"):
        cmp.cross_mesh_plan(a, _base("b4").with_placements([Shard(0)], 2), (8, 12, 2), ITEM)
    with pytest.raises(ValueError, match="must not be Partial"):
        cmp.p2p_plan(_base("a4").with_placements([Partial()], 2), a, (8, 12), ITEM)
