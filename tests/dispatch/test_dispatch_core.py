"""EntryDispatcher core: elementwise and matmul parity (values and grads) vs single process."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from hyper_parallel.dispatch import dispatcher as _op_dispatch
from hyper_parallel.dispatch import modes as _modes


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
    from hyper_parallel.dispatch.rules import base
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


# ----------------------------------------------------------------------------- cache size under training
def _adam_cache_body():
    import torch.nn as nn
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    w0, b0, x = torch.randn(6, 4), torch.randn(6), torch.randn(3, 4)
    sizes = {}
    for foreach in (False, True):
        for opt_cls in (torch.optim.Adam, torch.optim.AdamW):
            w = nn.Parameter(hp.distribute_tensor(w0.clone(), mesh, [Shard(0)]))
            b = nn.Parameter(hp.distribute_tensor(b0.clone(), mesh, [Replicate()]))
            rw, rb = nn.Parameter(w0.clone()), nn.Parameter(b0.clone())
            dx = hp.distribute_tensor(x, mesh, [Replicate()])
            opt = opt_cls([w, b], lr=0.05, foreach=foreach)
            ref = opt_cls([rw, rb], lr=0.05, foreach=foreach)
            hist = []
            for step in range(50):
                for o in (opt, ref):   # a schedule: lr (a float argument of the update ops) changes every step
                    o.param_groups[0]["lr"] = 0.05 / (1 + step)
                    o.zero_grad()
                (F.linear(dx, w) + b).tanh().sum().backward()
                (F.linear(x, rw) + rb).tanh().sum().backward()
                opt.step()
                ref.step()
                hist.append((len(_op_dispatch._CACHE), len(_op_dispatch._FAST), _op_dispatch.cache_stats()["misses"]))
            label = (opt_cls.__name__, foreach)
            assert hist[-1] == hist[2], (label, hist[2], hist[-1])   # no new entries, no misses after step 3
            torch.testing.assert_close(w.full_tensor(), rw.detach(), rtol=1e-5, atol=1e-6, msg=str(label))
            torch.testing.assert_close(b.full_tensor(), rb.detach(), rtol=1e-5, atol=1e-6, msg=str(label))
            sizes[label] = hist[-1][0]
    # rules whose answer depends on a float value still see it: dropout's p
    d = hp.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    assert torch.equal(F.dropout(d, 0.0).full_tensor(), torch.ones(4, 4))
    assert torch.equal(F.dropout(d, 1.0).full_tensor(), torch.zeros(4, 4))
    # the caches are bounded: the oldest entry goes first
    old = _op_dispatch._CACHE_MAX
    _op_dispatch._CACHE_MAX = 3
    try:
        _op_dispatch.clear_cache()
        for n in range(2, 8):
            hp.ones(n, device_mesh=mesh, placements=[Replicate()]).exp()
        assert len(_op_dispatch._CACHE) <= 3 and len(_op_dispatch._FAST) <= 3
    finally:
        _op_dispatch._CACHE_MAX = old
    return sizes


def test_cache_does_not_grow_during_training(dist_runner):
    dist_runner.run(2, _adam_cache_body)


# ----------------------------------------------------------------------------- strict mode, debug log, cheapest plan
def _row_and_col_sharded_ones():
    """Two (4, 4) ones on a (2,) mesh, Shard(0) and Shard(1): adding them needs a redistribution."""
    mesh = hp.init_device_mesh("cpu", (2,))
    return (hp.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]),
            hp.distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)]))


def _strict_body():
    a, c = _row_and_col_sharded_ones()

    def check(msg):
        assert "add" in msg, msg                                   # the op
        assert "input 0: [S(0)]" in msg and "input 1: [S(1)]" in msg, msg   # both input layouts
        assert ".redistribute(" in msg and "set_strict_layouts(False)" in msg, msg   # the fix
    hp.set_strict_layouts(True)
    try:
        with pytest.raises(RuntimeError, match="strict layouts") as ei:
            a + c
        check(str(ei.value))
        with pytest.raises(RuntimeError, match="strict layouts"):   # cached: raises again
            a + c
        assert (a + a).placements == (Shard(0),)                    # no redistribution needed: fine
        with hp.strict_layouts(False):
            torch.testing.assert_close((a + c).full_tensor(), torch.full((4, 4), 2.0))
        with pytest.raises(RuntimeError, match="strict layouts"):
            a + c
    finally:
        hp.set_strict_layouts(False)
    torch.testing.assert_close((a + c).full_tensor(), torch.full((4, 4), 2.0))
    with hp.strict_layouts():
        with pytest.raises(RuntimeError, match="strict layouts") as ei:
            torch.add(a, c)
        check(str(ei.value))
    torch.testing.assert_close(torch.add(a, c).full_tensor(), torch.full((4, 4), 2.0))


def test_strict_layouts_message(dist_runner):
    dist_runner.run(2, _strict_body)


def _debug_log_body():
    import logging
    a, c = _row_and_col_sharded_ones()
    records = []

    class H(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logger = logging.getLogger("hyper_parallel.dispatch")
    h = H()
    logger.addHandler(h)
    try:
        hp.set_debug(True)
        a * c
        assert len(records) == 1 and "mul" in records[0] and "input 1 [S(1)] -> [S(0)]" in records[0], records
        a * a                                   # nothing redistributed: nothing logged
        assert len(records) == 1, records
        hp.set_debug(False)
        a - c
        assert len(records) == 1, records
    finally:
        hp.set_debug(False)
        logger.removeHandler(h)


def test_debug_logging(dist_runner):
    dist_runner.run(2, _debug_log_body)


def test_debug_env_variable():
    env = _modes._debug_from_env
    assert env({"HYPER_PARALLEL_DEBUG": "1"}) and env({"HYPER_PARALLEL_DEBUG": "true"})
    assert not env({}) and not env({"HYPER_PARALLEL_DEBUG": "0"}) and not env({"HYPER_PARALLEL_DEBUG": ""})


def _cheapest_body():
    mesh = hp.init_device_mesh("cpu", (2,))
    big, small = torch.randn(64, 32), torch.randn(1, 32)
    db = hp.distribute_tensor(big, mesh, [Shard(0)])
    for f in (lambda x, y: x + y, lambda x, y: y * x):     # either argument order
        ds = hp.distribute_tensor(small, mesh, [Shard(1)])   # fresh: redistributions are memoised per DTensor
        with hp.CommDebugMode() as comm:
            out = f(db, ds)
        assert out.placements == (Shard(0),), out.placements     # the big input did not move
        assert comm.get_comm_counts() == {"all_gather": 1}, comm.get_comm_counts()
        assert comm.get_total_bytes() <= small.numel() * 4, comm.get_bytes()
        torch.testing.assert_close(out.full_tensor(), f(big, small))
    # matmul: a big S(0) activation and a small weight sharded on the contracted dim: gather the weight
    w = torch.randn(32, 8)
    dw = hp.distribute_tensor(w, mesh, [Shard(0)])
    with hp.CommDebugMode() as comm:
        out = db @ dw
    assert out.placements == (Shard(0),), out.placements
    assert comm.get_total_bytes() <= w.numel() * 4, comm.get_bytes()
    torch.testing.assert_close(out.full_tensor(), big @ w, rtol=1e-5, atol=1e-5)


def test_cheapest_redistribution_chosen(dist_runner):
    dist_runner.run(2, _cheapest_body)


def test_local_move_shortcut_matches_planner():
    """``is_local_move`` (which lets rules skip planning) is only True when the planner's plan is free."""
    import itertools
    from hyper_parallel import Partial
    from hyper_parallel.dtensor import redistribute_plan as rp
    from hyper_parallel.core.dtensor.layout import Layout
    from hyper_parallel.dispatch.rules.base import is_local_move
    n_free = 0
    for mesh_shape in ((2, 2, 2), (1, 4), (4,)):
        base = Layout(mesh_shape, tuple(f"m{i}" for i in range(len(mesh_shape))))
        choices = [Replicate(), Shard(0), Shard(1), Partial()] + ([Partial("max")] if len(mesh_shape) < 3 else [])
        layouts = [base.with_placements(p, 2) for p in itertools.product(choices, repeat=len(mesh_shape))]
        layouts.append(base.with_dim_map(((), tuple(reversed(range(len(mesh_shape))))), None))  # reversed order
        for src, dst in itertools.product(layouts, layouts):
            if is_local_move(src, dst):
                n_free += 1
                plan = rp.plan(src, dst, (5, 7), 4)
                assert all(not s.is_comm and s.max_bytes() == 0 for s in plan.steps), (src, dst, plan.steps)
    assert n_free > 150
