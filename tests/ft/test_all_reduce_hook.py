"""``FSDPModule.set_all_reduce_hook``: torchft's contract, checked against torch 2.13's FSDP2 on the same ranks.

torchft (and torchtitan's torchft path) set a hook on every FSDP module that all-reduces the
reduce-scatter output over the replica groups in place. FSDP2 calls it with the averaged
reduce-scatter output (the sums with ``set_force_sum_reduction_for_comms(True)``, divided
afterwards) before the sharded gradient is assigned from the tensor. Here the hook records what it
sees and changes the tensor in place (times 3, plus the rank): the recorded inputs and the
resulting gradients must equal torch's, step after step.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hyper_parallel as hp
from hyper_parallel.fsdp import fully_shard
from tests.fsdp.test_fsdp import _data, _make


def _hook_run(force_sum: bool):
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh, tmesh = hp.init_device_mesh("cpu", (world,)), torch_mesh("cpu", (world,))
    ours = _make().float()
    theirs = copy.deepcopy(ours)
    seen = {"ours": [], "theirs": []}

    def hook_for(key):
        def hook(out: torch.Tensor) -> None:
            seen[key].append(out.detach().clone())
            out.mul_(3.0).add_(rank)  # in place, as torchft's all_reduce is
        return hook

    for model, shard, who in ((ours, fully_shard, "ours"), (theirs, torch_fully_shard, "theirs")):
        m = mesh if who == "ours" else tmesh
        for b in model.blocks:
            shard(b, mesh=m)
        shard(model, mesh=m)
        for mod in model.modules():
            if hasattr(mod, "set_all_reduce_hook"):
                mod.set_force_sum_reduction_for_comms(force_sum)
                mod.set_all_reduce_hook(hook_for(who))
    o1 = torch.optim.SGD(ours.parameters(), lr=1e-2)
    o2 = torch.optim.SGD(theirs.parameters(), lr=1e-2)
    for s in range(3):
        x, y = _data(s)
        x, y = x.float()[rank::world], y.float()[rank::world]
        (ours(x) - y).pow(2).mean().backward()
        (theirs(x) - y).pow(2).mean().backward()
        for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad._local_tensor, q.grad.to_local(), rtol=1e-5, atol=1e-6, msg=n)
        o1.step(), o2.step(), o1.zero_grad(), o2.zero_grad()
    assert len(seen["ours"]) == len(seen["theirs"]) == 3 * 4  # 4 FSDP modules, 3 steps
    # torch runs the hooks in post-backward order, we at the end of backward (root first): compare as sets
    key = lambda t: (t.numel(), round(float(t.double().sum()), 3))
    a, b = sorted(seen["ours"], key=key), sorted(seen["theirs"], key=key)
    for t1, t2 in zip(a, b):
        assert t1.numel() <= t2.numel()  # torch pads each parameter to a multiple of the world size too
        torch.testing.assert_close(t1[:t1.numel()], t2[:t1.numel()], rtol=1e-5, atol=1e-6)
    return True


def _hook_errors():
    world = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (world,))
    m = _make()
    fully_shard(m, mesh=mesh)
    with pytest.raises(TypeError, match="set_all_reduce_hook: hook must be callable, got int"):
        m.set_all_reduce_hook(3)
    hsdp_mesh = hp.init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "shard"))
    m = _make()
    fully_shard(m, mesh=hsdp_mesh)
    with pytest.raises(ValueError, match="stream cannot be set when using native HSDP"):
        m.set_all_reduce_hook(lambda t: None, stream=object())
    # a hook on an HSDP module sees the all-reduce output (the replicate dim already averaged)
    m.set_all_reduce_hook(lambda t: t.zero_())
    x, y = _data(0)
    (m(x) - y).pow(2).mean().backward()
    assert all(float(p.grad._local_tensor.abs().sum()) == 0.0 for p in m.parameters())
    return True


@pytest.mark.parametrize("force_sum", [False, True])
def test_all_reduce_hook_matches_torch_fsdp2_2(dist_runner, force_sum):
    assert dist_runner.run(2, _hook_run, force_sum) == [True] * 2


def test_all_reduce_hook_errors_2(dist_runner):
    assert dist_runner.run(2, _hook_errors) == [True] * 2
