"""Redistribution planner (pure, no processes): step kinds, byte predictions, optimality, caching."""
import itertools

import pytest

from hyper_parallel import Layout, Partial, Replicate, Shard
from hyper_parallel.dtensor import redistribute_plan as rp
from hyper_parallel.dtensor.redistribute_plan import plan
from hyper_parallel.distributed import comm_record as rec

B1 = Layout((4,), ("x",))
B2 = Layout((2, 2), ("dp", "tp"))
B3 = Layout((2, 2, 2), ("pp", "dp", "tp"))


def L(base, *placements):
    return base.with_placements(list(placements), 2)


def kinds(p):
    return [s.kind for s in p.steps]


def cost(p):
    """The planner's objective: sum over steps of the largest per-rank bytes."""
    return sum(s.max_bytes() for s in p.steps)


# ------------------------------------------------------------------ single-step plans (1-D mesh)

@pytest.mark.parametrize("shape", [(8, 8), (3, 5), (16, 4)], ids=str)
def test_s0_to_s1_is_one_all_to_all(shape):
    p = plan(L(B1, Shard(0)), L(B1, Shard(1)), shape, 4)
    assert kinds(p) == ["all_to_all"]
    st = p.steps[0]
    assert (st.mesh_dim, st.tensor_dim, st.dst_dim) == (0, 0, 1)
    assert p.collective_counts() == {"all_to_all": 1}


def test_s0_to_s1_bytes_even():
    p = plan(L(B1, Shard(0)), L(B1, Shard(1)), (8, 8), 4)
    # local (2, 8) = 64 B; a rank keeps 1/4 of it and sends the rest
    assert p.steps[0].bytes == (48,) * 4
    assert p.bytes_for_rank(2) == 48


def test_s0_to_s1_bytes_uneven():
    # (3, 5) on 4 ranks: local rows 1,1,1,0; columns split 2,2,1,0
    p = plan(L(B1, Shard(0)), L(B1, Shard(1)), (3, 5), 4)
    # rank i holds 1x5 (i<3) and keeps column piece i: sends 5 - cols[i] elements
    assert p.steps[0].bytes == ((5 - 2) * 4, (5 - 2) * 4, (5 - 1) * 4, 0)


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_partial_to_shard_is_one_reduce_scatter(op):
    p = plan(L(B1, Partial(op)), L(B1, Shard(0)), (8, 8), 4)
    assert kinds(p) == ["reduce_scatter"]
    assert p.steps[0].reduce_op == op
    # input 8x8 fp32 = 256 B, sends 3/4 of it
    assert p.steps[0].bytes == (192,) * 4
    p = plan(L(B1, Partial(op)), L(B1, Shard(1)), (3, 5), 4)
    assert kinds(p) == ["reduce_scatter"] and p.steps[0].tensor_dim == 1
    # 5 columns -> 2,2,1,0; padded to 4 x 2 columns x 3 rows = 24 elements
    assert p.steps[0].bytes == (24 * 4 * 3 // 4,) * 4


@pytest.mark.parametrize("op", ["max", "min", "prod"])
def test_partial_nonlinear_to_shard_is_one_reduce_scatter(op):
    p = plan(L(B1, Partial(op)), L(B1, Shard(0)), (8, 8), 4)
    assert kinds(p) == ["reduce_scatter"]
    assert p.steps[0].reduce_op == op


def test_partial_to_replicate_is_one_all_reduce():
    p = plan(L(B1, Partial()), L(B1, Replicate()), (8, 8), 4)
    assert kinds(p) == ["all_reduce"]
    assert p.steps[0].bytes == (2 * 256 * 3 // 4,) * 4


@pytest.mark.parametrize("dim", [0, 1])
def test_shard_to_replicate_is_one_all_gather(dim):
    p = plan(L(B1, Shard(dim)), L(B1, Replicate()), (8, 8), 4)
    assert kinds(p) == ["all_gather"]
    assert p.steps[0].tensor_dim == dim
    assert p.steps[0].bytes == (64 * 3,) * 4


def test_shard_to_replicate_uneven_bytes_are_padded():
    # (3, 5) rows over 4 ranks: pieces 1,1,1,0 -> every rank sends a padded 1x5 piece to 3 peers
    p = plan(L(B1, Shard(0)), L(B1, Replicate()), (3, 5), 4)
    assert p.steps[0].bytes == (5 * 4 * 3,) * 4
    assert p.steps[0].sizes[0] == (1, 1, 1, 0)


@pytest.mark.parametrize("dim", [0, 1])
def test_replicate_to_shard_is_local_split(dim):
    p = plan(L(B1, Replicate()), L(B1, Shard(dim)), (8, 8), 4)
    assert kinds(p) == ["split"]
    assert p.collective_counts() == {}
    assert all(p.bytes_for_rank(i) == 0 for i in range(4))


def test_replicate_to_partial_is_local():
    p = plan(L(B1, Replicate()), L(B1, Partial()), (8, 8), 4)
    assert kinds(p) == ["to_partial"] and p.collective_counts() == {}
    assert p.bytes_for_rank(0) == 0


def test_identity_plan_is_empty():
    p = plan(L(B2, Shard(0), Partial()), L(B2, Shard(0), Partial()), (8, 8), 4)
    assert p.steps == () and p.collective_counts() == {} and p.bytes_for_rank(3) == 0


def test_2d_mesh_examples():
    p = plan(L(B2, Shard(0), Shard(1)), L(B2, Replicate(), Replicate()), (8, 8), 4)
    assert sorted(kinds(p)) == ["all_gather", "all_gather"]
    assert {s.mesh_dim for s in p.steps} == {0, 1}
    p = plan(L(B2, Shard(0), Replicate()), L(B2, Replicate(), Shard(1)), (8, 8), 4)
    assert p.collective_counts() == {"all_gather": 1}
    p = plan(L(B2, Partial(), Partial()), L(B2, Shard(0), Shard(1)), (8, 8), 4)
    assert p.collective_counts() == {"reduce_scatter": 2}
    # swapping the shard dims: cheaper than gathering everything and re-splitting
    src, dst = L(B2, Shard(0), Shard(1)), L(B2, Shard(1), Shard(0))
    p = plan(src, dst, (8, 8), 4)
    rep = src.replicated()
    assert cost(p) < cost(plan(src, rep, (8, 8), 4)) + cost(plan(rep, dst, (8, 8), 4))
    assert "all_to_all" in kinds(p)


def test_size_one_mesh_dim_is_relabel_only():
    base = Layout((1, 4), ("a", "b"))
    p = plan(base("a", "b"), base("None", "b"), (8, 8), 4)
    assert p.collective_counts() == {}
    assert all(p.bytes_for_rank(i) == 0 for i in range(4))
    p = plan(base.with_placements([Partial(), Shard(0)], 2), base.with_placements([Replicate(), Shard(0)], 2),
             (8, 8), 4)
    assert p.collective_counts() == {}


# ------------------------------------------------------------------ optimality

def test_direct_all_to_all_beats_gather_then_split():
    src, dst, rep = L(B1, Shard(0)), L(B1, Shard(1)), L(B1, Replicate())
    for shape in [(8, 8), (3, 5), (1024, 1024)]:
        direct = plan(src, dst, shape, 4)
        detour = cost(plan(src, rep, shape, 4)) + cost(plan(rep, dst, shape, 4))
        assert cost(direct) < detour, (shape, direct)
        for i in range(4):
            via = plan(src, rep, shape, 4).bytes_for_rank(i) + plan(rep, dst, shape, 4).bytes_for_rank(i)
            assert direct.bytes_for_rank(i) <= via


def test_reduce_scatter_beats_all_reduce_then_split():
    src, dst, rep = L(B1, Partial()), L(B1, Shard(0)), L(B1, Replicate())
    direct = plan(src, dst, (8, 8), 4)
    assert cost(direct) < cost(plan(src, rep, (8, 8), 4))


def _placement_sets(n_mesh, with_partial):
    opts = [Replicate(), Shard(0), Shard(1)] + ([Partial()] if with_partial else [])
    return list(itertools.product(opts, repeat=n_mesh))


@pytest.mark.parametrize("base", [B1, B2, B3], ids=["4", "2x2", "2x2x2"])
@pytest.mark.parametrize("shape", [(8, 8), (3, 5)], ids=str)
def test_never_worse_than_via_replicate(base, shape):
    """No plan costs more than the route through full replication (gather all, then split)."""
    n = len(base.mesh_shape)
    for sp in _placement_sets(n, True):
        for dp in _placement_sets(n, True):
            src, dst = L(base, *sp), L(base, *dp)
            rep = src.replicated()
            p = plan(src, dst, shape, 4)
            via = cost(plan(src, rep, shape, 4)) + cost(plan(rep, dst, shape, 4))
            assert cost(p) <= via, (sp, dp, p)
            # the plan ends where it should and uses only known kinds
            assert all(s.kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "split",
                                  "to_partial", "relabel") for s in p.steps)
            # a shard -> other-shard move on a 1-D mesh is one all_to_all, never a gather
            if n == 1 and sp[0].is_shard() and dp[0].is_shard() and sp != dp:
                assert kinds(p) == ["all_to_all"], (sp, dp, p)
            # Partial -> Shard(sum) is one reduce_scatter, never all_reduce + split
            if n == 1 and sp[0].is_partial() and dp[0].is_shard():
                assert kinds(p) == ["reduce_scatter"], (sp, dp, p)


def test_plan_bytes_match_comm_record_formula():
    """The planner predicts with the executor's formula: check against comm_record.bytes_sent."""
    p = plan(L(B1, Shard(0)), L(B1, Replicate()), (8, 8), 4)
    assert p.steps[0].bytes[0] == rec.bytes_sent("all_gather", 2 * 8 * 4, 4)
    p = plan(L(B1, Partial()), L(B1, Replicate()), (8, 8), 4)
    assert p.steps[0].bytes[0] == rec.bytes_sent("all_reduce", 64 * 4, 4)
    p = plan(L(B1, Partial()), L(B1, Shard(0)), (8, 8), 4)
    assert p.steps[0].bytes[0] == rec.bytes_sent("reduce_scatter", 64 * 4, 4)
    p = plan(L(B1, Shard(0)), L(B1, Shard(1)), (8, 8), 4)
    assert p.steps[0].bytes[0] == rec.bytes_sent("all_to_all", 16 * 4, 4)


def test_itemsize_scales_bytes():
    a = plan(L(B1, Shard(0)), L(B1, Replicate()), (8, 8), 4)
    b = plan(L(B1, Shard(0)), L(B1, Replicate()), (8, 8), 2)
    assert a.steps[0].bytes == tuple(2 * x for x in b.steps[0].bytes)


# ------------------------------------------------------------------ errors and caching

def test_different_meshes_raise_naming_both():
    with pytest.raises(ValueError, match=r"different meshes.*\(4,\).*\(2, 2\)"):
        plan(L(B1, Shard(0)), L(B2, Shard(0), Replicate()), (8, 8), 4)
    other = Layout((4,), ("x",), rank_list=(4, 5, 6, 7))
    with pytest.raises(ValueError, match=r"\(4,\) ranks \(0, 1, 2, 3\) vs \(4,\) ranks \(4, 5, 6, 7\)"):
        plan(L(B1, Shard(0)), L(other, Shard(0)), (8, 8), 4)


def test_rank_mismatch_raises():
    with pytest.raises(ValueError, match="2-d and 3-d"):
        plan(L(B1, Shard(0)), B1.with_placements([Shard(0)], 3), (8, 8), 4)
    with pytest.raises(ValueError, match=r"tensor shape is \(8, 8, 8\)"):
        plan(L(B1, Shard(0)), L(B1, Shard(1)), (8, 8, 8), 4)


def test_plans_are_cached():
    src, dst = L(B2, Shard(0), Shard(1)), L(B2, Shard(1), Replicate())
    before = rp._plan_cached.cache_info()
    p1 = plan(src, dst, (12, 10), 4)
    mid = rp._plan_cached.cache_info()
    p2 = plan(src, dst, [12, 10], 4)
    # equal-but-distinct layout objects hit the same cache entry
    p3 = plan(B2.with_placements([Shard(0), Shard(1)], 2), B2.with_placements([Shard(1), Replicate()], 2),
              (12, 10), 4)
    after = rp._plan_cached.cache_info()
    assert p1.steps is p2.steps is p3.steps
    assert after.hits - mid.hits == 2
    assert mid.misses - before.misses <= 1
    # a different shape or itemsize is a different entry
    assert plan(src, dst, (12, 10), 2).steps is not p1.steps
