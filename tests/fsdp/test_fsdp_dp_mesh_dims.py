"""``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(shard=...))`` (torch 2.13):
parameters are DTensors on the full SPMD mesh, ``Replicate()`` on the dp dim; training equals one
process (float64, losses and weights), on a torch mesh built as torchtitan builds it."""
from __future__ import annotations

import pytest


def _mlp_module(w1, w2, mesh):
    import torch
    import torch.nn.functional as F

    import hyper_parallel as hp
    from hyper_parallel import Replicate, Shard

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(hp.distribute_tensor(w1, mesh, [Replicate(), Shard(0)]))  # colwise on tp
            self.b = torch.nn.Parameter(hp.distribute_tensor(w2, mesh, [Replicate(), Shard(1)]))  # rowwise on tp

        def forward(self, x):
            return F.linear(torch.tanh(F.linear(x, self.a)), self.b)
    return MLP()


def _body():
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import hyper_parallel as hp
    from hyper_parallel import Partial, Replicate, Shard
    from hyper_parallel.fsdp import DataParallelMeshDims, fully_shard
    ws = dist.get_world_size()
    world = init_device_mesh("cpu", (ws,), mesh_dim_names=("world",))
    full = world._unflatten(0, (2, ws // 2), ("fsdp", "tp"))
    torch.manual_seed(0)
    w1 = torch.randn(16, 8, dtype=torch.float64)
    w2 = torch.randn(8, 16, dtype=torch.float64)
    batches = [torch.randn(4, 8, dtype=torch.float64) for _ in range(3)]

    def fwd(a, b, x):
        return F.linear(torch.tanh(F.linear(x, a)), b)

    # one process
    ra, rb = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    ref_losses = []
    for xb in batches:
        loss = (fwd(ra, rb, xb) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for p in (ra, rb):
                p -= 0.1 * p.grad
                p.grad = None
        ref_losses.append(loss.item())

    model = _mlp_module(w1, w2, full)
    with pytest.raises(ValueError, match="names mesh dim 'dp'"):
        fully_shard(model, mesh=full, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    fully_shard(model, mesh=full, dp_mesh_dims=DataParallelMeshDims(shard="fsdp"))
    # the loss is the global mean, so its gradient pieces sum to the whole gradient: no division
    # (torchtitan's full_dtensor does this; torch's default divides the summed pieces by the dp size)
    model.set_gradient_divide_factor(1.0)
    assert tuple(model.a.device_mesh.mesh_dim_names) == ("fsdp", "tp")
    fs = full["fsdp"]
    k, f = fs.size(), fs.get_local_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, xb in enumerate(batches):
        # the batch sharded over fsdp on the full mesh (torch's full_dtensor style)
        x = hp.DTensor.from_local(xb.chunk(k)[f], full, [Shard(0), Replicate()])
        y = model(x)
        assert tuple(y.placements) == (Shard(0), Partial())
        loss = (y ** 2).mean()          # the global mean over the whole batch
        loss.full_tensor().backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss.full_tensor().item(), ref_losses[i], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.a.full_tensor(), ra.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.b.full_tensor(), rb.detach(), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        DataParallelMeshDims()
    return True


def test_fully_shard_dp_mesh_dims(dist_runner):
    assert dist_runner.run(4, _body, timeout=240) == [True] * 4


def _nested_body():
    """Children sharded first, then the root (torchtitan's order): the root skips the children's parameters."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import hyper_parallel as hp
    from hyper_parallel import Replicate, Shard
    from hyper_parallel.fsdp import DataParallelMeshDims, fully_shard
    ws = dist.get_world_size()
    world = init_device_mesh("cpu", (ws,), mesh_dim_names=("world",))
    full = world._unflatten(0, (2, ws // 2), ("dp_shard", "tp"))
    torch.manual_seed(0)
    ws1 = [torch.randn(16, 8, dtype=torch.float64) for _ in range(2)]
    ws2 = [torch.randn(8, 16, dtype=torch.float64) for _ in range(2)]
    head = torch.randn(8, 8, dtype=torch.float64)
    batches = [torch.randn(4, 8, dtype=torch.float64) for _ in range(3)]

    ref = [w.clone().requires_grad_() for w in ws1 + ws2 + [head]]

    def fwd(params, x):
        a0, a1, b0, b1, h = params
        for a, b in ((a0, b0), (a1, b1)):
            x = x + F.linear(torch.tanh(F.linear(x, a)), b)
        return F.linear(x, h)
    ref_losses, ref_grads = [], None
    for xb in batches:
        loss = (fwd(ref, xb) ** 2).mean()
        loss.backward()
        if ref_grads is None:
            ref_grads = [p.grad.clone() for p in ref]
        with torch.no_grad():
            for p in ref:
                p -= 0.1 * p.grad
                p.grad = None
        ref_losses.append(loss.item())

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(_mlp_module(a, b, full) for a, b in zip(ws1, ws2))
            self.head = torch.nn.Parameter(hp.distribute_tensor(head, full, [Replicate(), Replicate()]))

        def forward(self, x):
            for blk in self.blocks:
                x = x + blk(x)
            return F.linear(x, self.head)
    fs = full["dp_shard"]
    k, f = fs.size(), fs.get_local_rank()
    dims = DataParallelMeshDims(shard="dp_shard")
    for divide in (None, 1.0):
        model = Root()
        for blk in model.blocks:
            fully_shard(blk, mesh=full, dp_mesh_dims=dims)
        fully_shard(model, mesh=full, dp_mesh_dims=dims)   # raised: a block's S(0) on 'dp_shard'
        if divide is not None:
            for mod in (model, *model.blocks):
                mod.set_gradient_divide_factor(divide)
        x = hp.DTensor.from_local(batches[0].chunk(k)[f], full, [Shard(0), Replicate()])
        (model(x) ** 2).mean().full_tensor().backward()
        got = [model.blocks[0].a, model.blocks[1].a, model.blocks[0].b, model.blocks[1].b, model.head]
        # as torch's FSDP2 (checked with torch on these 4 ranks): the gradient pieces over the dp dim are
        # reduce-scattered once, divided by the dp size unless a divide factor is set
        for g, r in zip(got, ref_grads):
            torch.testing.assert_close(g.grad.full_tensor(), r / (k if divide is None else divide),
                                       rtol=1e-10, atol=1e-12)
        model.zero_grad()
    assert tuple(model.head.placements) == (Shard(0), Replicate())
    # dim 0 sharded by tp first, then by dp_shard (the outer mesh dim): torch's label for that order
    from hyper_parallel.dtensor.placement_types import _StridedShard
    assert tuple(model.blocks[0].a.placements) == (_StridedShard(0, split_factor=ws // 2), Shard(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, xb in enumerate(batches):
        x = hp.DTensor.from_local(xb.chunk(k)[f], full, [Shard(0), Replicate()])
        loss = (model(x) ** 2).mean()
        loss.full_tensor().backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss.full_tensor().item(), ref_losses[i], rtol=1e-10, atol=1e-12)
    got = [model.blocks[0].a, model.blocks[1].a, model.blocks[0].b, model.blocks[1].b, model.head]
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.full_tensor(), r.detach(), rtol=1e-10, atol=1e-12)
    return True


def test_fully_shard_dp_mesh_dims_nested(dist_runner):
    assert dist_runner.run(4, _nested_body, timeout=240) == [True] * 4
