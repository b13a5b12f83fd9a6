"""gather / index_select on a sharded gather (select) dim compute locally (HyperParallel's cases pass
under strict layouts).

Each rank looks up the index entries that fall in its piece of the dim (the others give 0), so the
output is ``Partial(sum)`` over the mesh dims sharding that dim and the backward adds into the
rank's own piece only. For each layout: the forward runs with no collective under
``hp.strict_layouts()``, the output has the expected placements, and values and the input's
gradient equal one process in float64 at 1e-10. Uneven and empty pieces, duplicate and
out-of-order indices, Partial inputs, sharded indices and plain indices are included; layouts the
rules cannot compute locally still redistribute (raise under strict layouts, one process's results
without), and an out-of-range index raises ``IndexError`` as in torch.
"""
import pytest
import torch

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from hyper_parallel.device_mesh import init_device_mesh as torch_style_mesh

from tests.harness.parity import _randn, check_local, check_redistributes

TOL = dict(rtol=1e-10, atol=1e-10)
R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()






def _idx(high, shape, seed):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _gather(dim, **kw):
    return lambda x, i: torch.gather(x, dim, i, **kw)


def _isel(dim):
    return lambda x, i: torch.index_select(x, dim, i)




# ----------------------------------------------------------------------------- (2, 2) mesh, 4 ranks
def _mesh22_body():
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    n = 0
    x3 = _randn(8, 6, 5)
    # HyperParallel's gather cases (gather_ops_dp_dim0/dp_dim1/2d_*/sparse_grad/rp_dim0/multi_shard/...)
    _run("gather dp dim0", mesh, _gather(0), [(x3, [S0, R]), (_idx(8, (8, 6, 5), 1), [R, R])], [P, R])
    _run("gather dp dim1", mesh, _gather(1), [(x3, [R, S1]), (_idx(6, (8, 6, 5), 2), [R, R])], [R, P])
    _run("gather sparse_grad=False", mesh, _gather(0, sparse_grad=False),
         [(_randn(8, 6), [S0, R]), (_idx(8, (8, 6), 3), [R, R])], [P, R])
    # the index sharded on the gather dim by the other mesh dim: output laid out like the index + Partial
    _run("gather rp dim0", mesh, _gather(0), [(x3, [S0, R]), (_idx(8, (8, 6, 5), 4), [R, S0])], [P, S0])
    # input and index share the shard of a non-gather dim (same size)
    _run("gather multi shard", mesh, _gather(0),
         [(_randn(8, 6), [S0, S1]), (_idx(8, (8, 6), 5), [R, S1])], [P, S1])
    # the input's non-gather shard is kept and the (whole) index split locally there
    _run("gather index split locally", mesh, _gather(1),
         [(_randn(8, 6), [S0, S1]), (_idx(6, (8, 6), 6), [R, R])], [S0, P])
    # a smaller index (1 row; 2 rows of duplicates / out of order), as HyperParallel's special patterns
    _run("gather single row", mesh, _gather(0), [(_randn(8, 6), [S0, R]), (_idx(8, (1, 6), 7), [R, R])], [P, R])
    dup = torch.tensor([1, 3, 5, 7, 7, 1]).repeat(2, 1)
    _run("gather duplicates", mesh, _gather(0), [(_randn(8, 6), [S0, R]), (dup, [R, R])], [P, R])
    ooo = torch.tensor([7, 3, 1, 6, 0, 4]).repeat(2, 1)
    _run("gather out of order", mesh, _gather(0), [(_randn(8, 6), [S0, R]), (ooo, [R, R])], [P, R])
    # smaller index on a non-gather dim (5 < 6 columns): that dim whole on both sides
    _run("gather smaller index", mesh, _gather(0), [(_randn(7, 6), [S0, R]), (_idx(7, (4, 5), 8), [R, R])], [P, R])
    # gather dim over both mesh dims, uneven (7 rows over 4 ranks: 2, 2, 2, 1), negative dim
    _run("gather dim over (dp, tp) uneven", mesh, _gather(-2),
         [(_randn(7, 3), [S0, S0]), (_idx(7, (9, 3), 9), [R, R])], [P, P])
    # a Partial(sum) input stays pending next to the new Partial(sum)
    _run("gather partial input", mesh, _gather(0), [(_randn(8, 6), [S0, P]), (_idx(8, (5, 6), 10), [R, R])], [P, P])
    # Tensor method
    _run("Tensor.gather", mesh, lambda x, i: x.gather(1, i),
         [(_randn(4, 7), [R, S1]), (_idx(7, (4, 3), 11), [S0, R])], [S0, P])
    n += 13
    # HyperParallel's index_select cases (sharded_dim0/dim1, duplicate, out_of_order, neg_sharded)
    x2 = _randn(8, 4)
    _run("index_select dim0", mesh, _isel(0), [(x2, [S0, R]), (torch.tensor([1, 3]), [R, R])], [P, R])
    _run("index_select dim1", mesh, _isel(1), [(x2, [R, S1]), (torch.tensor([1, 2]), [R, R])], [R, P])
    _run("index_select duplicate", mesh, _isel(0), [(x2, [S0, R]), (torch.tensor([1, 1, 3, 2, 1]), [R, R])], [P, R])
    _run("index_select out of order", mesh, _isel(0),
         [(x2, [S0, R]), (torch.tensor([6, 1, 7, 0, 3]), [R, R])], [P, R])
    _run("index_select neg dim", mesh, _isel(-1), [(x2, [R, S1]), (torch.tensor([1, 2]), [R, R])], [R, P])
    # other dims keep their shards; the select dim is Partial
    _run("index_select 3-d", mesh, _isel(2),
         [(_randn(4, 6, 8), [S0, S2]), (torch.tensor([7, 0, 3, 3]), [R, R])], [S0, P])
    # a sharded 1-d index gives the output dim its shard
    _run("index_select sharded index", mesh, _isel(0),
         [(_randn(8, 3), [S0, R]), (torch.tensor([5, 0, 7, 2, 2]), [R, S0])], [P, S0])
    # select dim over both mesh dims, uneven (5 rows: 2, 2, 1, 0 - one rank holds no row)
    _run("index_select (dp, tp) uneven", mesh, _isel(0),
         [(_randn(5, 3), [S0, S0]), (torch.tensor([4, 0, 2, 3, 4, 1]), [R, R])], [P, P])
    # a Partial(sum) input; the Tensor method; a 0-d index
    _run("index_select partial input", mesh, lambda x, i: x.index_select(1, i),
         [(_randn(3, 6), [P, S1]), (torch.tensor([5, 2]), [R, R])], [P, P])
    _run("index_select 0-d index", mesh, _isel(0), [(x2, [S0, R]), (torch.tensor(6), [R, R])], [P, R])
    n += 10
    # a plain index tensor on HyperParallel's mesh counts as replicated
    idx = torch.tensor([3, 0, 6])
    _run("index_select plain index", mesh, lambda x: torch.index_select(x, 0, idx), [(x2, [S0, R])], [P, R])
    n += 1
    # a dim not sharded: as before (no Partial)
    _run("gather unsharded dim", mesh, _gather(1), [(x3, [S0, S2]), (_idx(6, (8, 6, 5), 12), [S0, S2])], [S0, S2])
    _run("index_select unsharded dim", mesh, _isel(1), [(x2, [S0, R]), (torch.tensor([3, 1]), [R, S0])], [S0, S1])
    n += 2
    # layouts that still redistribute: the index sharded on the gather dim by the mesh dim that shards
    # the input's gather dim (the output cannot be sharded and Partial on one mesh dim)
    _still_gathers(mesh, "gather conflict", _gather(0),
                         [(_randn(8, 6), [S0, R]), (_idx(8, (8, 6), 13), [S0, R])], [S0, R], "gather")
    _still_gathers(mesh, "index_select conflict", _isel(0),
                         [(_randn(8, 6), [S0, R]), (torch.tensor([1, 6, 2, 7]), [S0, R])], [P, R], "index_select")
    n += 2
    return n


def test_local_gather_index_select_on_2x2(dist_runner):
    assert dist_runner.run(4, _mesh22_body) == [28] * 4


# ----------------------------------------------------------------------------- 1-d meshes
def _mesh1d_body():
    ws = torch.distributed.get_world_size()
    n = 0
    for mesh in (hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",)),
                 torch_style_mesh("cpu", (ws,), mesh_dim_names=("tp",))):  # PyTorch's mesh too
        # uneven with an empty piece on 4 ranks (3 rows over 4: 1, 1, 1, 0)
        _run("gather uneven", mesh, _gather(0), [(_randn(3, 5), [S0]), (_idx(3, (6, 5), 1), [R])], [P])
        _run("index_select uneven", mesh, _isel(0), [(_randn(3, 5), [S0]), (torch.tensor([2, 0, 2, 1]), [R])], [P])
        # 7 columns over ws: gather along the last dim
        _run("gather last dim", mesh, _gather(-1), [(_randn(4, 7), [S1]), (_idx(7, (4, 9), 2), [R])], [P])
        _run("index_select last dim", mesh, _isel(1), [(_randn(4, 7), [S1]), (torch.tensor([6, 0, 3]), [R])], [P])
        # a plain index tensor (an index op: accepted on PyTorch's meshes too, as replicated)
        pidx = torch.tensor([1, 2, 2, 0])
        _run("index_select plain index", mesh, lambda x: torch.index_select(x, 0, pidx), [(_randn(3, 5), [S0])], [P])
        n += 5
    mesh = hp.init_device_mesh("cpu", (ws,))
    x = hp.distribute_tensor(_randn(6, 4), mesh, [S0])
    with pytest.raises(IndexError, match="index 6 is out of bounds for dim of size 6"):
        torch.gather(x, 0, hp.distribute_tensor(torch.tensor([[6, 0, 1, 2]]), mesh, [R]))
    with pytest.raises(IndexError, match="index -1 is out of bounds for dim of size 6"):
        torch.index_select(x, 0, hp.distribute_tensor(torch.tensor([0, -1]), mesh, [R]))
    n += 2
    return n


def test_local_gather_index_select_on_1d_meshes(dist_runner):
    assert dist_runner.run(2, _mesh1d_body) == [12] * 2
    assert dist_runner.run(4, _mesh1d_body) == [12] * 4


def _run(label, mesh, f, inputs, placements):
    check_local(label, mesh, f, inputs, placements, tol=TOL)


def _still_gathers(mesh, label, f, inputs, out_pl, match):
    check_redistributes(label, mesh, f, inputs, out_pl, match, tol=TOL)
