"""fully_shard([m1, m2]) (a list of modules sharded as one group) and set_is_last_backward (FSDP2 semantics).

2 ranks, float64, against one process (1e-10):

* ``fully_shard([model.blocks[-1], model.head])``: one group for both modules: one all_gather
  per forward (before the first of them runs) and one reduce_scatter per backward, both modules
  FSDPModules sharing one state, parameter names unchanged; reshard after forward happens only
  once both modules ran; AdamW parity over several steps.
* ``set_is_last_backward(False)``: the backward issues its reduce_scatters but leaves them in
  flight (the sharded gradients are still empty afterwards); the next backward with
  ``set_is_last_backward(True)`` lands them: gradients equal one process's sum over both
  microbatches, with one reduce_scatter per group and backward.
* Bad lists: empty, the same module twice, a module inside another, an already sharded one.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import hyper_parallel as hp
from hyper_parallel.fsdp import FSDPModule, fully_shard
from tests.fsdp.test_fsdp import DT, TOL, _data, _full, _make, _train


def _rs_count(comm):
    return comm.get_comm_counts().get("reduce_scatter", 0)


def _ag_count(comm):
    return comm.get_comm_counts().get("all_gather", 0)


def _shard_with_list(model, mesh):
    for b in model.blocks[:-1]:
        fully_shard(b, mesh=mesh)
    out = fully_shard([model.blocks[-1], model.head], mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    return out


def _list_group():
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ref = _make()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses = _train(ref, ref_opt, 4)
    model = _make()
    out = _shard_with_list(model, mesh)
    assert out == [model.blocks[-1], model.head]
    assert isinstance(model.head, FSDPModule) and isinstance(model.blocks[-1], FSDPModule)
    assert model.head._hp_fsdp_state is model.blocks[-1]._hp_fsdp_state  # one state, one group
    assert set(dict(model.named_parameters())) == set(dict(ref.named_parameters()))
    for n, p in model.named_parameters():
        assert isinstance(p, hp.DTensor) and tuple(p.placements) == (hp.Shard(0),), n
    groups = 3  # blocks[0], blocks[1], [blocks[2], head]; the root holds inp
    groups += 1
    # reshard-after-forward waits for the last module of the group: after blocks[-1] alone its
    # parameters stay unsharded, after head both are sharded again
    seen = {}
    def note(key, mod):
        def hook(m, a, o):
            seen.setdefault(key, isinstance(mod.w1.weight, hp.DTensor))
        return hook
    h1 = model.blocks[-1].register_forward_hook(note("after_block", model.blocks[-1]))
    h2 = model.head.register_forward_hook(note("after_head", model.blocks[-1]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with hp.CommDebugMode() as comm:
        losses = _train(model, opt, 1, rank, world)
    h1.remove(), h2.remove()
    # hooks run after FSDP's own post-forward hook (registered first): blocks[-1] still unsharded,
    # after head's forward the group resharded
    assert seen == {"after_block": False, "after_head": True}, seen
    # forward: one all_gather per group; backward: re-gather of the resharded groups (not the root)
    assert _ag_count(comm) == 2 * groups - 1, comm.get_comm_counts()
    assert _rs_count(comm) == groups, comm.get_comm_counts()
    losses += _train_from(model, opt, 1, 3, rank, world)
    torch.testing.assert_close(torch.tensor(losses, dtype=DT), torch.tensor(ref_losses, dtype=DT), **TOL)
    rsd = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(_full(p), rsd[n].detach(), **TOL, msg=n)
    return True


def _train_from(model, opt, start, steps, rank, world, clip=0.05):
    losses = []
    for s in range(start, start + steps):
        x, y = _data(s)
        n = x.shape[0] // world
        loss = (model(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]).pow(2).mean()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        l = loss.detach().clone()
        dist.all_reduce(l)
        losses.append(l.item() / world)
    return losses


def _last_backward():
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ref = _make()
    for s in range(2):  # two microbatches, gradients summed
        x, y = _data(s)
        (ref(x) - y).pow(2).mean().backward()
    model = _make()
    _shard_with_list(model, mesh)
    groups = 4
    n = 8 // world
    out = {}
    for s, last in ((0, False), (1, True)):
        x, y = _data(s)
        model.set_is_last_backward(last)
        with hp.CommDebugMode() as comm:
            (model(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]).pow(2).mean().backward()
        out[s] = _rs_count(comm)
        if not last:
            # the reduce_scatters were issued but not landed: no sharded gradient yet
            assert all(p.grad is None for p in model.parameters()), "is_last_backward=False landed gradients"
    assert out == {0: groups, 1: groups}, out
    rsd = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p.grad), rsd[name].grad, **TOL, msg=name)
    # the default again: one backward lands its own reductions
    model.set_is_last_backward(True)
    model.zero_grad()
    x, y = _data(0)
    (model(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]).pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    return True


def _bad_lists():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = _make()
    with pytest.raises(ValueError, match="empty list"):
        fully_shard([], mesh=mesh)
    with pytest.raises(ValueError, match=r"module\[0\] and module\[1\] are the same"):
        fully_shard([model.head, model.head], mesh=mesh)
    with pytest.raises(ValueError, match=r"module\[1\] \(Linear\) is inside module\[0\] \(Block\)"):
        fully_shard([model.blocks[0], model.blocks[0].w1], mesh=mesh)
    with pytest.raises(TypeError, match=r"module\[1\] must be an nn.Module"):
        fully_shard([model.head, 3], mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    with pytest.raises(RuntimeError, match="already applied"):
        fully_shard([model.inp, model.head], mesh=mesh)
    assert not isinstance(model.inp, FSDPModule)  # nothing changed by the failed call
    return True


def test_fully_shard_list_is_one_group(dist_runner):
    assert dist_runner.run(2, _list_group) == [True, True]


def test_set_is_last_backward_defers_reductions(dist_runner):
    assert dist_runner.run(2, _last_backward) == [True, True]


def test_fully_shard_list_bad_input(dist_runner):
    assert dist_runner.run(2, _bad_lists) == [True, True]
