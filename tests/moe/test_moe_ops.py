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


def test_route_topk():
    g = torch.Generator().manual_seed(4)
    T, E, k = 7, 8, 2
    logits = torch.randn(T, E, dtype=torch.float64, generator=g)
    w, ids = moe.route_topk(logits, k)                                   # softmax, no bias
    s = logits.float().softmax(-1)
    ref = s.topk(k, dim=-1)
    assert torch.equal(ids, ref.indices)
    torch.testing.assert_close(w, ref.values.double())
    # the bias changes the choice, not the weights; sigmoid weights are normalised
    bias = torch.zeros(E, dtype=torch.float64)
    bias[ids[:, 0]] = -10.0                                              # forbid every token's first choice
    w2, ids2 = moe.route_topk(logits, k, score_func="sigmoid", expert_bias=bias)
    sg = logits.float().sigmoid()
    for t in range(T):
        allowed = [e for e in range(E) if bias[e] == 0]
        want = sorted(allowed, key=lambda e: -sg[t, e].item())[:k]
        assert ids2[t].tolist() == want
        ww = sg[t, ids2[t]] / sg[t, ids2[t]].sum()
        torch.testing.assert_close(w2[t], ww.double())
    # group-limited: 4 groups of 2, the 2 best groups by the sum of their two scores are eligible
    w3, ids3 = moe.route_topk(logits, k, score_func="sigmoid", num_groups=4, top_groups=2, scale=2.5)
    for t in range(T):
        gs = sg[t].view(4, 2).sum(-1)
        groups = gs.topk(2).indices.tolist()
        cand = [e for e in range(E) if e // 2 in groups]
        want = sorted(cand, key=lambda e: -sg[t, e].item())[:k]
        assert ids3[t].tolist() == want
        torch.testing.assert_close(w3[t], (2.5 * sg[t, ids3[t]] / sg[t, ids3[t]].sum()).double())
    with pytest.raises(ValueError, match=r"top_k=9 must be an int in \[1, num_experts=8\]"):
        moe.route_topk(logits, 9)
    with pytest.raises(ValueError, match="num_groups=3 must divide num_experts=8"):
        moe.route_topk(logits, 2, num_groups=3, top_groups=1)
