"""DFunction, DistributedOp registration, SkipDTensorDispatch, local_map, unknown ops and fallback."""
import threading
import warnings

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import DFunction, DistributedOp, Replicate, Shard, SkipDTensorDispatch


class ScaleAddRule(DistributedOp):
    def infer_layout(self, layouts, extra_args=None):
        return layouts[0]


ScaleAddRule("ScaleAdd")


class ScaleAdd(DFunction):
    """x * scale + y with a hand-written backward."""
    _op_name = "ScaleAdd"

    @staticmethod
    def forward(ctx, x, scale, y):
        ctx.scale = scale
        return x * scale + y

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None, g


class NoName(DFunction):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def test_dfunction_plain_path():
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    out = ScaleAdd.apply(x, 3.0, y)
    out.sum().backward()
    torch.testing.assert_close(out, x.detach() * 3 + y.detach())
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0))


def _dfunction_dist():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    dx = hp.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    dy = hp.distribute_tensor(y, mesh, [Shard(0)]).requires_grad_()
    out = ScaleAdd.apply(dx, 2.0, dy)          # non-tensor positional arg preserved
    assert isinstance(out, hp.DTensor) and out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), 2 * x + y)
    out.full_tensor().sum().backward()
    torch.testing.assert_close(dx.grad.full_tensor(), torch.full((6, 4), 2.0))
    torch.testing.assert_close(dy.grad.full_tensor(), torch.ones(6, 4))
    with pytest.raises(ValueError, match="NoName"):
        NoName.apply(dx)


def test_dfunction_distributed(dist_runner):
    dist_runner.run(2, _dfunction_dist)


def _skip():
    mesh = hp.init_device_mesh("cpu", (2,))
    dt = hp.ones(4, 2, device_mesh=mesh, placements=[Shard(0)])
    with SkipDTensorDispatch(no_skip={torch.zeros_like}):
        s = dt + dt
        assert type(s) is torch.Tensor and s.shape == (2, 2)
        z = torch.zeros_like(dt)
        assert isinstance(z, hp.DTensor) and z.shape == (4, 2)
        with SkipDTensorDispatch():                   # nested
            assert type(dt * 2) is torch.Tensor
            assert type(torch.zeros_like(dt)) is torch.Tensor
        assert isinstance(torch.zeros_like(dt), hp.DTensor)
    assert isinstance(dt + dt, hp.DTensor)
    # the skip state is per thread
    seen = {}

    def other():
        seen["type"] = type(dt + dt)
    with SkipDTensorDispatch():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["type"] is hp.DTensor
    with SkipDTensorDispatch(no_skip={"add"}):
        assert isinstance(dt + dt, hp.DTensor)


def test_skip_dtensor_dispatch(dist_runner):
    dist_runner.run(2, _skip)


def _local_map():
    mesh = hp.init_device_mesh("cpu", (2,))
    x = torch.arange(8.0).view(4, 2)
    dx = hp.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()

    def rowsum(t):
        return t.sum(dim=1)
    f = hp.local_map(rowsum, out_placements=[Shard(0)], in_placements=([Shard(0)],))
    out = f(dx)
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), x.sum(1))
    out.full_tensor().sum().backward()
    torch.testing.assert_close(dx.grad.full_tensor(), torch.ones(4, 2))
    g = hp.local_map(rowsum, out_placements=[Shard(0)], in_placements=([Replicate()],))
    with pytest.raises(ValueError, match="redistribute_inputs"):
        g(dx)
    g2 = hp.local_map(rowsum, out_placements=[Replicate()], in_placements=([Replicate()],), redistribute_inputs=True)
    torch.testing.assert_close(g2(dx).full_tensor(), x.sum(1))


def test_local_map(dist_runner):
    dist_runner.run(2, _local_map)


def _unknown_and_fallback():
    mesh = hp.init_device_mesh("cpu", (2,))
    x = torch.randn(4, 4)
    dx = hp.distribute_tensor(x, mesh, [Shard(0)])
    with pytest.raises(NotImplementedError) as ei:
        torch.linalg.det(dx)
    msg = str(ei.value)
    assert "det" in msg and "DistributedOp" in msg and "S(0)" in msg and "allow_replicate_fallback" in msg
    hp.allow_replicate_fallback(True)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            r1 = torch.linalg.det(dx)
            r2 = torch.linalg.det(dx)
        assert sum("no sharding rule" in str(x.message) for x in w) == 1, [str(x.message) for x in w]
        torch.testing.assert_close(r1.full_tensor(), torch.linalg.det(x))
        assert r2.placements == (Replicate(),)
    finally:
        hp.allow_replicate_fallback(False)
    # plain tensors mixed with DTensors
    torch.testing.assert_close((dx * torch.tensor(2.0)).full_tensor(), x * 2)
    from hyper_parallel.device_mesh import init_device_mesh as torch_init_device_mesh
    tdx = hp.distribute_tensor(x, torch_init_device_mesh("cpu", (2,)), [Shard(0)])
    with pytest.raises(RuntimeError, match="implicit_replication"):  # PyTorch's meshes (HyperParallel's: replicated)
        tdx + torch.ones(4, 4)
    with hp.implicit_replication():
        torch.testing.assert_close((dx + torch.ones(4, 4)).full_tensor(), x + 1)


def test_unknown_op_and_fallback(dist_runner):
    dist_runner.run(2, _unknown_and_fallback)


def _skip_threads():
    from hyper_parallel.dispatch import dispatcher as _op_dispatch
    mesh = hp.init_device_mesh("cpu", (2,))
    dt = hp.ones(4, 2, device_mesh=mesh, placements=[Shard(0)])
    n_iter = 300
    errors = []
    barrier = threading.Barrier(4)

    def inside(nested):          # enters and leaves skip contexts over and over
        try:
            barrier.wait()
            for i in range(n_iter):
                with SkipDTensorDispatch():
                    if nested and i % 2:
                        with SkipDTensorDispatch(no_skip={"mul"}):
                            assert isinstance(dt * 2, hp.DTensor)
                            assert type(dt + dt) is torch.Tensor
                    r = dt + dt
                    assert type(r) is torch.Tensor and r.shape == (2, 2), type(r)
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))

    def outside():               # never in a context: always DTensor behaviour
        try:
            barrier.wait()
            for _ in range(n_iter):
                r = dt + dt
                assert type(r) is hp.DTensor and r.shape == (4, 2), type(r)
                assert type(dt * 3.0) is hp.DTensor
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))
    ts = [threading.Thread(target=inside, args=(False,)), threading.Thread(target=inside, args=(True,)),
          threading.Thread(target=outside), threading.Thread(target=outside)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[:3]
    assert _op_dispatch._SKIP_ANY[0] == 0
    # specials (detach, item, tolist) run on the local tensor inside the context when dispatch reaches
    # them through _slow_path; printing keeps its DTensor meaning; no_skip keeps DTensor behaviour
    h = _op_dispatch._slow_path
    one = hp.ones(2, device_mesh=mesh, placements=[Shard(0)])
    with SkipDTensorDispatch():
        assert type(h(torch.Tensor.detach, (), (dt,), {})) is torch.Tensor
        assert h(torch.Tensor.item, (), (one,), {}) == 1.0                 # the local 1-element shard
        assert h(torch.Tensor.tolist, (), (dt,), {}) == [[1.0, 1.0]] * 2   # the local (2, 2) shard
        assert "DTensor" in h(torch.Tensor.__repr__, (), (dt,), {})
        with SkipDTensorDispatch(no_skip={"detach"}):
            assert isinstance(h(torch.Tensor.detach, (), (dt,), {}), hp.DTensor)
    assert isinstance(h(torch.Tensor.detach, (), (dt,), {}), hp.DTensor)
    assert h(torch.Tensor.tolist, (), (dt,), {}) == [[1.0, 1.0]] * 4


def test_skip_dtensor_dispatch_threads(dist_runner):
    dist_runner.run(2, _skip_threads)


def _fallback_two_ops():
    mesh = hp.init_device_mesh("cpu", (2,))
    torch.manual_seed(3)
    x = torch.randn(4, 4) + 4 * torch.eye(4)
    dx = hp.distribute_tensor(x, mesh, [Shard(0)])
    hp.allow_replicate_fallback(True)   # every enabling starts afresh: ops warned about earlier warn again
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(3):
                d = torch.linalg.det(dx)
                i = torch.linalg.inv(dx)
        msgs = [str(m.message) for m in w if "no sharding rule" in str(m.message)]
        assert len(msgs) == 2 and any("'linalg_det'" in m for m in msgs) and any("'linalg_inv'" in m for m in msgs), \
            msgs
        torch.testing.assert_close(d.full_tensor(), torch.linalg.det(x))
        torch.testing.assert_close(i.full_tensor(), torch.linalg.inv(x))
        hp.allow_replicate_fallback(True)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.linalg.det(dx)
        assert sum("no sharding rule" in str(m.message) for m in w) == 1
    finally:
        hp.allow_replicate_fallback(False)
    with pytest.raises(NotImplementedError, match="linalg_inv"):
        torch.linalg.inv(dx)


def test_fallback_warns_once_per_op(dist_runner):
    dist_runner.run(2, _fallback_two_ops)


def _local_map_multi():
    mesh = hp.init_device_mesh("cpu", (2,))
    x = torch.arange(12.0).view(6, 2)
    dx = hp.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()

    def stats(t, scale):                 # several outputs: sharded, partial, and a non-tensor
        return t * scale, t.sum(0), "done"
    f = hp.local_map(stats, out_placements=([Shard(0)], [hp.Partial()], None), in_placements=([Shard(0)], None))
    a, s, tag = f(dx, 3.0)
    assert tag == "done" and a.placements == (Shard(0),) and s.placements == (hp.Partial(),)
    torch.testing.assert_close(a.full_tensor(), x * 3)
    torch.testing.assert_close(s.full_tensor(), x.sum(0))
    (a.full_tensor().sum() + (s.full_tensor() * torch.tensor([1.0, 2.0])).sum()).backward()
    torch.testing.assert_close(dx.grad.full_tensor(), torch.tensor([[4.0, 5.0]]).expand(6, 2))
    with pytest.raises(ValueError, match="2 outputs but 1 out_placements"):
        hp.local_map(lambda t: (t, t), out_placements=([Shard(0)],))(dx)
    # custom_shard is the same function: redistributes when asked, on its declared placements
    assert hp.custom_shard is hp.local_map
    g = hp.custom_shard(lambda t, u: t @ u, out_placements=[Shard(0)],
                        in_placements=([Shard(0)], [Replicate()]), redistribute_inputs=True)
    w = torch.tensor([[1.0, -1.0], [2.0, 0.5]])
    dw = hp.distribute_tensor(w, mesh, [Shard(1)]).requires_grad_()
    out = g(dx.detach().redistribute(mesh, [Replicate()]), dw)
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), x @ w)
    out.full_tensor().sum().backward()
    torch.testing.assert_close(dw.grad.full_tensor(), x.sum(0)[:, None].expand(2, 2))
    # torch 2.13: a plain tensor where placements are declared is passed as it is (no check); a
    # non-tensor there is an error
    torch.testing.assert_close(hp.local_map(lambda t, u: t * u, out_placements=[Shard(0)],
                                            in_placements=([Shard(0)], [Replicate()]))(dx, torch.tensor(2.0))
                               .full_tensor(), x * 2)
    with pytest.raises(TypeError, match="argument 1 should be a DTensor"):
        g(dx, 2.0)


def test_local_map_multi_output_and_custom_shard(dist_runner):
    dist_runner.run(2, _local_map_multi)
