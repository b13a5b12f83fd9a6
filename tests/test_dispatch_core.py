"""Dispatcher core: elementwise and matmul parity (values and grads) vs single process."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from hyper_parallel.core.shard import _op_dispatch


def _mlp_colrow():
    torch.manual_seed(0)
    ws = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,))
    x = torch.randn(6, 8)
    w1 = torch.randn(12, 8, requires_grad=True)
    b1 = torch.randn(12, requires_grad=True)
    w2 = torch.randn(5, 12, requires_grad=True)
    b2 = torch.randn(5, requires_grad=True)
    ref = (F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2) ** 2).sum()
    ref.backward()
    dx = hp.distribute_tensor(x, mesh, [Replicate()])
    dw1 = hp.distribute_tensor(w1.detach(), mesh, [Shard(0)]).requires_grad_()
    db1 = hp.distribute_tensor(b1.detach(), mesh, [Shard(0)]).requires_grad_()
    dw2 = hp.distribute_tensor(w2.detach(), mesh, [Shard(1)]).requires_grad_()
    db2 = hp.distribute_tensor(b2.detach(), mesh, [Replicate()]).requires_grad_()
    with hp.CommDebugMode() as comm:
        h = F.linear(dx, dw1, db1)
        assert h.placements == (Shard(1),), h.placements
        y = F.linear(F.gelu(h), dw2, db2)
        assert y.placements == (Partial(),), y.placements
        loss = (y ** 2).sum()
        assert loss.placements == (Replicate(),), loss.placements
    assert comm.get_comm_counts() == {"all_reduce": 1}, comm.get_comm_counts()
    torch.testing.assert_close(loss.to_local(), ref.detach(), rtol=1e-5, atol=1e-5)
    with hp.CommDebugMode() as comm:
        loss.backward()
    assert comm.get_comm_counts() == {}, comm.get_comm_counts()
    for p, r in [(dw1, w1), (db1, b1), (dw2, w2), (db2, b2)]:
        assert isinstance(p.grad, hp.DTensor)
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-5)


def test_mlp_colwise_rowwise(dist_runner):
    dist_runner.run(2, _mlp_colrow)
    dist_runner.run(4, _mlp_colrow)


def _elementwise_mix():
    torch.manual_seed(1)
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a = torch.randn(5, 6, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    ref = (torch.where(a > 0, a * b, a - 2.0) / (b.abs() + 1)).sigmoid().sum()
    ref.backward()
    da = hp.distribute_tensor(a.detach(), mesh, [Shard(0), Shard(1)]).requires_grad_()
    db = hp.distribute_tensor(b.detach(), mesh, [Replicate(), Replicate()]).requires_grad_()
    out = (torch.where(da > 0, da * db, da - 2.0) / (db.abs() + 1)).sigmoid().sum()
    torch.testing.assert_close(out.full_tensor(), ref.detach(), rtol=1e-5, atol=1e-5)
    out.backward()
    torch.testing.assert_close(da.grad.full_tensor(), a.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db.grad.full_tensor(), b.grad, rtol=1e-5, atol=1e-5)
    # mixed shardings force a redistribution; strict mode raises instead
    dc = hp.distribute_tensor(a.detach(), mesh, [Shard(1), Replicate()])
    s = da + dc
    torch.testing.assert_close(s.full_tensor(), 2 * a.detach())
    with hp.strict_layouts():
        try:
            da + dc
        except RuntimeError as e:
            assert "strict" in str(e) and "add" in str(e)
        else:
            raise AssertionError("strict mode did not raise")
    # partial arithmetic: P + R counts R once, P * R stays partial
    p = hp.DTensor.from_local(torch.ones(3) * (dist.get_rank() + 1), mesh, [Partial(), Replicate()])
    r = hp.distribute_tensor(torch.full((3,), 10.0), mesh, [Replicate(), Replicate()])
    # ranks 0..3 -> coordinates on dp: 0,0,1,1 -> partial values (r+1) summed over dp pairs
    full_p = p.full_tensor()
    torch.testing.assert_close((p + r).full_tensor(), full_p + 10)
    torch.testing.assert_close((p * r).full_tensor(), full_p * 10)
    torch.testing.assert_close((p + 1.0).full_tensor(), full_p + 1)


def test_elementwise_mix(dist_runner):
    dist_runner.run(4, _elementwise_mix)


def _cache():
    from hyper_parallel.core.shard.ops import base
    mesh = hp.init_device_mesh("cpu", (2,))
    x = hp.ones(4, 4, device_mesh=mesh, placements=[Shard(0)])
    rule = base.get_rule("mul")
    calls = []
    orig = rule.strategy
    rule.strategy = lambda call: calls.append(call.name) or orig(call)
    try:
        before = _op_dispatch.cache_stats()
        x * x
        assert calls == ["mul"], calls
        x * x
        x * x
        assert calls == ["mul"], calls          # no layout inference on identical calls
        assert _op_dispatch.cache_stats()["misses"] == before["misses"] + 1
    finally:
        del rule.strategy


def test_cache_hit_skips_inference(dist_runner):
    dist_runner.run(2, _cache)
