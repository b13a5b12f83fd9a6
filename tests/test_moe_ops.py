"""hyper_parallel.moe: grouped matmul (helper and the ``_grouped_mm`` sharding rule) and balancing helpers."""
import math

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import moe, Partial, Replicate, Shard

TOL = dict(rtol=1e-12, atol=1e-12)


def _loop_ref(x, w, offs):
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=x.dtype)
    lo = 0
    for g, hi in enumerate(offs.tolist()):
        out[lo:hi] = x[lo:hi] @ w[g]
        lo = hi
    return out


def test_grouped_mm_helper():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 8, 4, dtype=torch.float64, generator=g, requires_grad=True)
    offs = torch.tensor([3, 3, 9, 10], dtype=torch.int32)        # an empty group; row 10 is past the end
    out = moe.grouped_mm(x, w, offs)
    torch.testing.assert_close(out, _loop_ref(x.detach(), w.detach(), offs), **TOL)
    assert out[10].abs().sum() == 0
    out.sum().backward()
    assert w.grad is not None and w.grad[1].abs().sum() == 0    # the empty group gets a zero gradient
    # torch's CPU kernel (float32, aligned) agrees with the loop
    # (and its backward, which fails on torch's own for out.sum()'s expanded gradient, works through ours)
    xf, wf = x.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    offs_all = torch.tensor([3, 3, 9, 11], dtype=torch.int32)
    out_n = moe.grouped_mm(xf, wf, offs_all, impl="native")
    gn = torch.autograd.grad(out_n.sum(), (xf, wf))
    out_l = moe.grouped_mm(xf, wf, offs_all, impl="loop")
    gl = torch.autograd.grad(out_l.sum(), (xf, wf))
    for a, b in zip((out_n,) + gn, (out_l,) + gl):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"offsets must be \[G\] = \[4\] cumulative row ends, got shape \(3,\)"):
        moe.grouped_mm(x, w, offs[:3])
    with pytest.raises(ValueError, match="impl must be 'auto', 'native' or 'loop', got 'x'"):
        moe.grouped_mm(x, w, offs, impl="x")


CASES_1D = [  # (x placements, w placements, output placements)
    ((Replicate(),), (Shard(0),), (Partial(),)),
    ((Shard(0),), (Replicate(),), (Shard(0),)),
    ((Replicate(),), (Shard(2),), (Shard(1),)),
    ((Shard(1),), (Shard(1),), (Partial(),)),
    ((Partial(),), (Replicate(),), (Partial(),)),
    ((Replicate(),), (Replicate(),), (Replicate(),)),
]
CASES_2D = [
    ((Replicate(), Shard(0)), (Shard(0), Replicate()), (Partial(), Shard(0))),   # experts x rows
    ((Replicate(), Replicate()), (Shard(0), Shard(2)), (Partial(), Shard(1))),   # ep x tp column
    ((Replicate(), Shard(1)), (Shard(0), Shard(1)), (Partial(), Partial())),     # ep x tp row
]


def _rule_cases(cases, shape):
    mesh = hp.init_device_mesh("cpu", shape)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 8, dtype=torch.float64, generator=g)
    w = torch.randn(4, 8, 6, dtype=torch.float64, generator=g)
    gy = torch.randn(10, 6, dtype=torch.float64, generator=g)
    offs = torch.tensor([2, 2, 7, 10], dtype=torch.int32)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = moe.grouped_mm(xr, wr, offs, impl="loop")
    (ref * gy).sum().backward()
    for px, pw, pout in cases:
        if isinstance(px[0], Partial) or (len(px) > 1 and isinstance(px[1], Partial)):
            xd = hp.DTensor.from_local(x / mesh.size(), mesh, px).detach().requires_grad_(True)  # pieces sum to x
        else:
            xd = hp.distribute_tensor(x.clone(), mesh, px).requires_grad_(True)
        wd = hp.distribute_tensor(w.clone(), mesh, pw).requires_grad_(True)
        with hp.CommDebugMode() as comm:
            out = torch._grouped_mm(xd, wd, offs=offs)
        assert comm.get_total_counts() == 0, (px, pw, comm.get_comm_counts())   # computed locally
        assert tuple(out.placements) == pout, (px, pw, out.placements)
        torch.testing.assert_close(out.full_tensor(), ref.detach(), **TOL)
        (out * hp.distribute_tensor(gy, mesh, [Replicate()] * mesh.ndim)).sum().backward()
        torch.testing.assert_close(wd.grad.full_tensor(), wr.grad, **TOL)
        if not any(isinstance(p, Partial) for p in px):
            torch.testing.assert_close(xd.grad.full_tensor(), xr.grad, **TOL)
    return True


def test_grouped_mm_rule(dist_runner):
    assert all(dist_runner.run(2, _rule_cases, CASES_1D, (2,)))
    assert all(dist_runner.run(4, _rule_cases, CASES_2D, (2, 2)))


def _balance():
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep"))
    E, k = 4, 2
    all_ids = [torch.randint(0, E, (5 + r, k), generator=torch.Generator().manual_seed(r)) for r in range(world)]
    counts = moe.tokens_per_expert(all_ids[rank], E, mesh)
    want = torch.bincount(torch.cat(all_ids).reshape(-1), minlength=E)
    assert counts.tolist() == want.tolist()
    bias = torch.zeros(E, dtype=torch.float64)
    moe.update_expert_bias(bias, counts, coeff=0.01)
    c = want.double()
    d = torch.sign(c.mean() - c)
    torch.testing.assert_close(bias, (d - d.mean()) * 0.01, **TOL)
    m = moe.load_metrics(counts)
    assert m["tokens_per_expert"] == want.tolist() and m["max"] == max(want.tolist())
    assert math.isclose(m["imbalance"], max(want.tolist()) / (sum(want.tolist()) / E))
    return bias.tolist()


def test_balancing(dist_runner):
    biases = dist_runner.run(4, _balance)
    assert all(b == biases[0] for b in biases)             # every rank applies the same update


def test_load_balance_loss():
    scores = torch.full((6, 4), 0.25, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3], [0, 1], [2, 3]])
    loss = moe.load_balance_loss(scores, ids, 4)
    assert abs(loss.item() - 1.0) < 1e-12               # uniform router, uniform load
    loss.backward()
    assert scores.grad is not None
