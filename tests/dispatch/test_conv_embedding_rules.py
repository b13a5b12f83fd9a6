"""Conv and embedding layouts that compute locally (HyperParallel's cases pass under strict layouts).

For each pattern (row-parallel conv -> Partial(sum) with the bias added once; pointwise spatial
shards; group-aligned channel shards, depthwise included; embedding with ``scale_grad_by_freq``
on sharded ids): the forward runs with no collective under ``hp.strict_layouts()``, the output
has the local placements, and values and gradients (input, weight, bias) equal one process in
float64 at 1e-10. Uneven and empty pieces are included; layouts the rules cannot compute locally
(kernel 3 on a spatial shard, groups not aligned with the shards) still redistribute, raise under
strict layouts and give one process's results without it.
"""
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard

from tests.harness.parity import _randn, check_local, check_redistributes

TOL = dict(rtol=1e-10, atol=1e-10)
R, S0, S1, S2, S3, S4, P = Replicate(), Shard(0), Shard(1), Shard(2), Shard(3), Shard(4), Partial()






def _ids(shape, vocab, seed):
    """Token ids with many repeats (so that frequencies matter)."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- (2, 2) mesh, 4 ranks
def _mesh22_body():
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    n = 0
    # row parallel (HyperParallel: conv1d_ops_row_parallel, conv3d_ops_row_parallel, conv3d_ops_dp_rp)
    _run("conv1d row", mesh, lambda x, w: F.conv1d(x, w),
         [(_randn(2, 4, 8), [R, S1]), (_randn(2, 4, 3, seed=1), [R, S1])], [R, P])
    _run("conv3d row", mesh, lambda x, w: F.conv3d(x, w),
         [(_randn(2, 4, 4, 4, 4), [R, S1]), (_randn(4, 4, 2, 2, 2, seed=1), [R, S1])], [R, P])
    _run("conv3d dp row", mesh, lambda x, w: F.conv3d(x, w),
         [(_randn(2, 4, 4, 4, 4), [S0, S1]), (_randn(2, 4, 2, 2, 2, seed=1), [R, S1])], [S0, P])
    # uneven channels (5 over 2), uneven batch (3 over 2), a bias added once, stride/padding/dilation
    _run("conv1d row bias uneven", mesh, lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=2, dilation=2),
         [(_randn(3, 5, 9), [S0, S1]), (_randn(2, 5, 3, seed=1), [R, S1]), (_randn(2, seed=2), [R, R])], [S0, P])
    # a replicated weight (or input) is split locally: still row parallel, no communication
    _run("conv2d row split weight", mesh, lambda x, w, b: F.conv2d(x, w, b, padding=1),
         [(_randn(2, 5, 4, 5), [R, S1]), (_randn(3, 5, 3, 3, seed=1), [R, R]), (_randn(3, seed=2), [R, R])], [R, P])
    _run("conv2d row split input", mesh, lambda x, w: F.conv2d(x, w),
         [(_randn(2, 5, 4, 5), [R, R]), (_randn(3, 5, 3, 3, seed=1), [R, S1])], [R, P])
    # row parallel x column parallel on the two mesh dims: Partial on tp, output channels on dp
    _run("conv1d row x column", mesh, lambda x, w, b: F.conv1d(x, w, b),
         [(_randn(2, 4, 8), [R, S1]), (_randn(6, 4, 3, seed=1), [S0, S1]), (_randn(6, seed=2), [S0, R])], [S1, P])
    # unbatched input
    _run("conv1d row unbatched", mesh, lambda x, w, b: F.conv1d(x, w, b),
         [(_randn(4, 8), [R, S0]), (_randn(3, 4, 3, seed=1), [R, S1]), (_randn(3, seed=2), [R, R])], [R, P])
    n += 8
    # pointwise spatial shards (HyperParallel: conv3d_ops_spatial_h, conv3d_ops_spatial_w)
    _run("conv3d spatial h", mesh, lambda x, w: F.conv3d(x, w),
         [(_randn(4, 2, 8, 4, 4), [R, S3]), (_randn(4, 2, 1, 1, 1, seed=1), [R, R])], [R, S3])
    _run("conv3d spatial w", mesh, lambda x, w: F.conv3d(x, w),
         [(_randn(2, 2, 4, 4, 8), [R, S4]), (_randn(4, 2, 1, 1, 1, seed=1), [R, R])], [R, S4])
    # uneven H (7 over 2) with kernel 1 along H only: D and W are convolved (padded) whole
    _run("conv3d spatial h uneven", mesh, lambda x, w, b: F.conv3d(x, w, b, padding=(1, 0, 1)),
         [(_randn(3, 2, 5, 7, 3), [S0, S3]), (_randn(4, 2, 2, 1, 3, seed=1), [R, R]), (_randn(4, seed=2), [R, R])],
         [S0, S3])
    # padding="same" pads nothing along a kernel-1 dim; spatial shard + row parallel on the two mesh dims
    _run("conv2d spatial same + row", mesh, lambda x, w: F.conv2d(x, w, padding="same"),
         [(_randn(2, 4, 5, 7), [S3, S1]), (_randn(3, 4, 3, 1, seed=1), [R, S1])], [S3, P])
    n += 4
    # group-aligned channel shards (HyperParallel: conv1d_ops_groups_dp_cp_with_bias, conv3d_ops_groups_cp*)
    _run("conv1d groups dp cp bias", mesh, lambda x, w, b: F.conv1d(x, w, bias=b, groups=2),
         [(_randn(4, 4, 8), [S0, R]), (_randn(4, 2, 3, seed=1), [R, S0]), (_randn(4, seed=2), [R, S0])], [S0, S1])
    _run("conv3d groups cp", mesh, lambda x, w: F.conv3d(x, w, groups=2),
         [(_randn(2, 4, 4, 4, 4), [R, R]), (_randn(4, 2, 2, 2, 2, seed=1), [R, S0])], [R, S1])
    _run("conv3d groups cp bias", mesh, lambda x, w, b: F.conv3d(x, w, bias=b, groups=2),
         [(_randn(2, 4, 4, 4, 4), [R, R]), (_randn(4, 2, 2, 2, 2, seed=1), [R, S0]), (_randn(4, seed=2), [R, S0])],
         [R, S1])
    # channels over both mesh dims: 4 groups, one per rank
    _run("conv2d groups over (dp, tp)", mesh, lambda x, w, b: F.conv2d(x, w, b, groups=4),
         [(_randn(2, 8, 3, 3), [S1, S1]), (_randn(12, 2, 2, 2, seed=1), [S0, S0]), (_randn(12, seed=2), [R, R])],
         [S1, S1])
    n += 4
    # embedding, scale_grad_by_freq=True, ids kept sharded (HyperParallel: embedding_ops_cp_padding_scale,
    # embedding_ops_cp_positional); frequencies are global: gradients equal one process
    ids = _ids((8, 16), 32, 3)
    emb_w = _randn(32, 64, seed=4)
    _run("embedding cp padding scale", mesh, lambda i, w: F.embedding(i, w, padding_idx=2, scale_grad_by_freq=True),
         [(ids, [S0, R]), (emb_w, [R, S1])], [S0, S2])
    _run("embedding cp positional", mesh, lambda i, w: F.embedding(i, w, 2, None, 2.0, True),
         [(ids, [S0, R]), (emb_w, [R, S1])], [S0, S2])
    # ids sharded over both mesh dims, uneven (5 x 7), replicated weight
    _run("embedding ids 2-d uneven", mesh, lambda i, w: F.embedding(i, w, scale_grad_by_freq=True),
         [(_ids((5, 7), 6, 5), [S0, S1]), (_randn(6, 3, seed=6), [R, R])], [S0, S1])
    # vocab-parallel weight (33 rows over tp) with sharded ids: Partial(sum), global counts
    _run("embedding vocab parallel scale", mesh,
         lambda i, w: F.embedding(i, w, padding_idx=-1, scale_grad_by_freq=True),
         [(_ids((6, 5), 33, 7), [S0, R]), (_randn(33, 4, seed=8), [R, S0])], [S0, P])
    # torch.embedding(weight, input, padding_idx, scale_grad_by_freq, sparse)
    _run("torch.embedding scale", mesh, lambda w, i: torch.embedding(w, i, 1, True),
         [(emb_w, [R, S1]), (ids, [S0, R])], [S0, S2])
    n += 5
    return n


def test_local_conv_and_embedding_on_2x2(dist_runner):
    assert dist_runner.run(4, _mesh22_body) == [21] * 4


# ----------------------------------------------------------------------------- 1-d meshes
def _mesh1d_body():
    ws = torch.distributed.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    n = 0
    # HyperParallel's 1-d cases: conv1d_ops_groups_cp_with_bias, conv1d_ops_depthwise_group_aligned
    # (on 4 ranks with 4 groups: 2 groups cannot be split over 4 ranks)
    _run("conv1d groups cp bias", mesh, lambda x, w, b: F.conv1d(x, w, bias=b, groups=ws),
         [(_randn(2, 2 * ws, 8), [R]), (_randn(2 * ws, 2, 3, seed=1), [S0]), (_randn(2 * ws, seed=2), [S0])], [S1])
    _run("conv1d depthwise", mesh, lambda x, w, b: F.conv1d(x, w, bias=b, groups=4),
         [(_randn(2, 4, 8), [S1]), (_randn(4, 1, 3, seed=1), [S0]), (_randn(4, seed=2), [S0])], [S1])
    # depthwise, uneven: 3 (2 ranks: 2 + 1 groups) or 6 groups (4 ranks: 2, 2, 2, 0 - one rank has none)
    g = 3 if ws == 2 else 6
    _run("conv2d depthwise uneven", mesh, lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=g),
         [(_randn(2, g, 4, 5), [S1]), (_randn(g, 1, 3, 3, seed=1), [R]), (_randn(g, seed=2), [R])], [S1])
    # row parallel with an empty piece on 4 ranks (3 channels over 4: 1, 1, 1, 0), bias added once
    c = 3 if ws == 4 else 5
    _run("conv1d row uneven", mesh, lambda x, w, b: F.conv1d(x, w, b, padding=1),
         [(_randn(2, c, 6), [S1]), (_randn(4, c, 3, seed=1), [S1]), (_randn(4, seed=2), [R])], [P])
    # pointwise spatial shard with an empty piece on 4 ranks (3 over 4)
    _run("conv2d spatial uneven", mesh, lambda x, w, b: F.conv2d(x, w, b),
         [(_randn(2, 3, 3, 4), [S2]), (_randn(5, 3, 1, 1, seed=1), [R]), (_randn(5, seed=2), [R])], [S2])
    # embedding: sequence-sharded ids, uneven (7 over ws)
    _run("embedding sp scale", mesh, lambda i, w: F.embedding(i, w, padding_idx=0, scale_grad_by_freq=True),
         [(_ids((3, 7), 5, 9), [S1]), (_randn(5, 4, seed=10), [R])], [S1])
    n += 6

    # layouts that still redistribute: raise under strict layouts, one process's results without
    cases = [
        ("conv2d kernel 3 on a spatial shard", lambda x, w: F.conv2d(x, w, padding=1),
         [(_randn(2, 3, 6, 5), [S2]), (_randn(4, 3, 3, 3, seed=1), [R])], [R]),
        ("conv1d stride 2 kernel 1 on a spatial shard", lambda x, w: F.conv1d(x, w, stride=2),
         [(_randn(2, 3, 8), [S2]), (_randn(4, 3, 1, seed=1), [R])], [R]),
        # 5 groups, 1 input and 2 output channels each: the output channel pieces (5 + 5 or 3 + 3 + 3 + 1)
        # cut groups
        ("conv1d groups not aligned", lambda x, w: F.conv1d(x, w, groups=5),
         [(_randn(2, 5, 8), [R]), (_randn(10, 1, 3, seed=1), [S0])], [R]),
    ]
    for label, f, inputs, out_pl in cases:
        check_redistributes(label, mesh, f, inputs, out_pl, "conv", tol=TOL)
        n += 1
    return n


def test_local_conv_and_embedding_on_1d_meshes(dist_runner):
    assert dist_runner.run(2, _mesh1d_body) == [9] * 2
    assert dist_runner.run(4, _mesh1d_body) == [9] * 4


# ----------------------------------------------------------------------------- the gradient is global
def _freq_body():
    """Per-shard frequencies (HyperParallel's scaling) would give another gradient: ours is one process's."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ids = torch.tensor([[1, 1, 1, 2], [1, 3, 3, 3]])       # rank 0 sees id 1 three times, rank 1 once
    w = _randn(4, 2, seed=1)
    ref_w = w.clone().requires_grad_()
    F.embedding(ids, ref_w, scale_grad_by_freq=True).sum().backward()
    dw = hp.distribute_tensor(w, mesh, [R]).requires_grad_()
    di = hp.distribute_tensor(ids, mesh, [S0])
    with hp.strict_layouts(), hp.CommDebugMode() as fwd:
        out = F.embedding(di, dw, scale_grad_by_freq=True)
    assert fwd.get_total_counts() == 0 and out.placements == (S0,)
    with hp.CommDebugMode() as bwd:
        out.full_tensor().sum().backward()
    assert bwd.get_comm_counts().get("all_reduce", 0) >= 1     # the per-row counts (and the weight grad)
    got = dw.grad.full_tensor()
    torch.testing.assert_close(got, ref_w.grad, **TOL)
    # the per-shard scaling differs here (id 1: 3/3 + 1/1 = 2 per column, the true value is 4/4 = 1)
    local = torch.zeros_like(w)
    for part in ids:
        r = w.clone().requires_grad_()
        F.embedding(part, r, scale_grad_by_freq=True).sum().backward()
        local += r.grad
    assert not torch.allclose(local, ref_w.grad)
    return float(got[1, 0])


def test_scale_grad_by_freq_uses_global_counts(dist_runner):
    assert dist_runner.run(2, _freq_body) == [1.0, 1.0]


def _run(label, mesh, f, inputs, placements):
    check_local(label, mesh, f, inputs, placements, tol=TOL)
