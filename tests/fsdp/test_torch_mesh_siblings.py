"""``fully_shard`` on sibling slices of one torch root mesh (torchtitan's meshes: ``world._unflatten``
then ``mesh["fsdp"]`` / ``mesh["tp"]``), also with a size-1 fsdp dim, and on slices of two different
unflattenings of one world mesh: FSDP x TP training equals one process (float64, losses and weights)."""
from __future__ import annotations

import pytest


def _mlp():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(16, 8, bias=False)).double()


def _train(model, batches, wrap_in=lambda x: x, unwrap=lambda y: y):
    import torch
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for xb in batches:
        loss = (unwrap(model(wrap_in(xb))) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _body(shape, two_unflattens):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import hyper_parallel as hp
    from hyper_parallel import ColwiseParallel, Replicate, RowwiseParallel, fully_shard, parallelize_module
    ws = dist.get_world_size()
    world = init_device_mesh("cpu", (ws,), mesh_dim_names=("world",))
    dense = world._unflatten(0, shape, ("fsdp", "tp"))
    # the fsdp slice from a second unflattening of the same world mesh (torchtitan's sparse/dense meshes)
    other = world._unflatten(0, shape, ("efsdp", "etp")) if two_unflattens else dense
    fsdp_mesh = other["efsdp" if two_unflattens else "fsdp"]
    torch.manual_seed(1)
    batches = [torch.randn(4, 8, dtype=torch.float64) for _ in range(3)]
    ref_losses = _train(_mlp(), batches)
    ref = _mlp()
    _train(ref, batches)
    model = _mlp()
    parallelize_module(model, dense["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=fsdp_mesh)
    w0 = model[0].weight
    assert tuple(w0.device_mesh.mesh_dim_names) == (("efsdp", "tp") if two_unflattens else ("fsdp", "tp"))
    # each fsdp rank trains on its own rows of the batch (the data-parallel split)
    f = fsdp_mesh.get_local_rank()
    k = fsdp_mesh.size()
    losses = _train(model, batches, wrap_in=lambda xb: xb.chunk(k)[f], unwrap=lambda y: y)
    # the loss of each dp rank is over its rows; average over fsdp ranks = the global loss
    for i, l in enumerate(losses):
        t = torch.tensor([l], dtype=torch.float64)
        dist.all_reduce(t, group=fsdp_mesh.get_group())
        torch.testing.assert_close(t.item() / k, ref_losses[i], rtol=1e-12, atol=1e-12)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-12, atol=1e-12, msg=n)
    return True


@pytest.mark.parametrize("ws,shape,two", [(2, (1, 2), False), (4, (2, 2), False), (4, (2, 2), True)])
def test_fully_shard_on_torch_sibling_slices(dist_runner, ws, shape, two):
    assert dist_runner.run(ws, _body, shape, two, timeout=240) == [True] * ws
