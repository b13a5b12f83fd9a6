"""``local_map`` with torch 2.13's signature: ``in_grad_placements=``, per-output ``out_placements``
tuples (``((Partial(),),)`` is one output), pytree inputs/outputs and decorator mode, checked against
torch's own ``local_map`` on torch's DTensor on the same ranks (float64, values and gradients)."""
from __future__ import annotations

import pytest


def _program(lib):
    """Runs with ``lib`` = torch's or hyper_parallel's DTensor names; returns full values and grads."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    DTensor, Shard, Replicate, Partial, distribute_tensor, local_map = lib
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4 * ws, dtype=torch.float64, generator=g)
    w = torch.randn(4 * ws, 5 * ws, dtype=torch.float64, generator=g)
    out = {}

    # (1) x sharded on its columns, w on its rows: the local product is a partial sum; torch's spelling of
    # one output's placements as a tuple of specs
    dx = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    dw = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    mm = local_map(torch.mm, out_placements=((Partial(),),), in_placements=((Shard(1),), (Shard(0),)))
    y = mm(dx, dw)
    assert isinstance(y, DTensor) and tuple(y.placements) == (Partial(),)
    yf = y.full_tensor()
    (yf * torch.arange(yf.numel(), dtype=yf.dtype).view_as(yf)).sum().backward()
    out["y1"], out["gx1"], out["gw1"] = yf.detach(), dx.grad.full_tensor(), dw.grad.full_tensor()

    # (2) a replicated input whose local gradient is partial: declared with in_grad_placements
    rx = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    cw = distribute_tensor(w, mesh, [Shard(1)]).requires_grad_()

    @local_map(out_placements=[Shard(1)], in_placements=([Replicate()], [Shard(1)]),
               in_grad_placements=([Partial()], [Shard(1)]))
    def colwise(a, b):
        return torch.tanh(a @ b)
    z = colwise(rx, cw)
    assert tuple(z.placements) == (Shard(1),)
    zf = z.full_tensor()
    (zf ** 2).sum().backward()
    out["z2"], out["gx2"], out["gw2"] = zf.detach(), rx.grad.full_tensor(), cw.grad.full_tensor()

    # (3) pytree in and out: a dict of two outputs and a non-tensor, one spec per flattened output
    def stats(pair, scale):
        a, b = pair
        return {"s": a * scale, "n": b.sum(0, keepdim=True), "tag": "ok"}
    f = local_map(stats, out_placements=([Shard(0)], [Partial()], None),
                  in_placements=((Shard(0),), (Shard(0),), None))
    xs = distribute_tensor(x.t().contiguous(), mesh, [Shard(0)])
    r = f((xs, xs), 2.0)
    assert r["tag"] == "ok" and tuple(r["s"].placements) == (Shard(0),) and tuple(r["n"].placements) == (Partial(),)
    out["s3"], out["n3"] = r["s"].full_tensor(), r["n"].full_tensor()
    return out


def _both():
    import torch
    from torch.distributed import tensor as tdt
    from torch.distributed.tensor.experimental import local_map as torch_local_map

    import hyper_parallel as hp
    theirs = _program((tdt.DTensor, tdt.Shard, tdt.Replicate, tdt.Partial, tdt.distribute_tensor, torch_local_map))
    ours = _program((hp.DTensor, hp.Shard, hp.Replicate, hp.Partial, hp.distribute_tensor, hp.local_map))
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-12, atol=1e-12, msg=k)
    return sorted(theirs)


def _errors():
    import torch
    import torch.distributed as dist

    import hyper_parallel as hp
    from hyper_parallel import Shard
    from hyper_parallel.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dx = hp.distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="in_grad_placements has 1 entries but the function got 2"):
        hp.local_map(torch.add, [Shard(0)], ([Shard(0)], [Shard(0)]), ([Shard(0)],))(dx, dx)
    with pytest.raises(ValueError, match=r"2 outputs but 1 out_placements"):
        hp.local_map(lambda t: (t, t), out_placements=([Shard(0)],))(dx)
    with pytest.raises(ValueError, match="in_grad_placements\\[0\\] is None"):
        hp.local_map(torch.neg, [Shard(0)], ([Shard(0)],), (None,))(dx)
    return True


@pytest.mark.parametrize("ws", [2])
def test_local_map_matches_torch(dist_runner, ws):
    assert dist_runner.run(ws, _both)[0] == ["gw1", "gw2", "gx1", "gx2", "n3", "s3", "y1", "z2"]


def test_local_map_errors(dist_runner):
    assert dist_runner.run(2, _errors) == [True, True]
