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
    with pytest.raises(RuntimeError, match="implicit_replication"):
        dx + torch.ones(4, 4)
    with hp.implicit_replication():
        torch.testing.assert_close((dx + torch.ones(4, 4)).full_tensor(), x + 1)


def test_unknown_op_and_fallback(dist_runner):
    dist_runner.run(2, _unknown_and_fallback)
