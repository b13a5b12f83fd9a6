"""fully_shard features beyond plain training: prefetch order, gradient accumulation, activation
checkpointing, per-rank save/load, explicit unshard/reshard, meta-device init, mixed precision against
torch's own FSDP2, and the bad-input errors (one distributed task per world size)."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import hyper_parallel as hp
from hyper_parallel.fsdp import MixedPrecisionPolicy, fully_shard
from tests.fsdp.test_fsdp import DT, TOL, Block, Net, _data, _make, _shard, _train, _check_parity


class CkptBlock(Block):
    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False)


def _events(comm):
    return [e[0] for e in comm.events]


def _prefetch_and_accumulation():
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (world,))
    # ---- implicit forward prefetch: when block i computes, block i+1's all_gather is already issued
    model = _shard(_make(), mesh)
    x, y = _data(0)
    xs, ys = x[rank::world], y[rank::world]
    (model(xs) - ys).pow(2).mean().backward()  # step 1 records the forward order
    seen = []
    with hp.CommDebugMode() as comm:
        hooks = [b.register_forward_pre_hook(lambda m, a: seen.append(comm.get_comm_counts().get("all_gather", 0)))
                 for b in model.blocks]
        loss = (model(xs) - ys).pow(2).mean()
        for h in hooks:
            h.remove()
    assert seen == [3, 4, 4], seen  # root + block0 + block1 issued before block0 computes; last: nothing ahead
    with hp.CommDebugMode() as comm:
        loss.backward()
    # backward prefetch: the next block's all_gather goes out before this block's reduce_scatter
    assert _events(comm) == ["all_gather", "all_gather", "reduce_scatter", "all_gather", "reduce_scatter",
                             "reduce_scatter", "reduce_scatter"], _events(comm)
    # ---- explicit prefetch lists
    model = _shard(_make(), mesh)
    blocks = list(model.blocks)
    model.set_modules_to_forward_prefetch([blocks[0], blocks[1]])
    blocks[2].set_modules_to_backward_prefetch([blocks[1], blocks[0]])
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, a: seen.append(comm.get_comm_counts().get("all_gather", 0)))
             for b in model.blocks]
    with hp.CommDebugMode() as comm:
        loss = (model(xs) - ys).pow(2).mean()
    assert seen == [3, 3, 4], seen
    with hp.CommDebugMode() as comm:
        loss.backward()
    ev = _events(comm)
    assert ev[:4] == ["all_gather", "all_gather", "all_gather", "reduce_scatter"], ev
    assert ev.count("all_gather") == 3 and ev.count("reduce_scatter") == 4, ev
    # ---- gradient accumulation: 4 micro-batches, sync off on the first 3 == one big batch
    ref = _make()
    x, y = _data(3, n=8 * world)
    (ref(x) - y).pow(2).mean().backward()
    for raf in (None, False):
        model = _shard(_make(), mesh, raf)
        xs, ys = x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]
        for mb in range(4):
            model.set_requires_gradient_sync(mb == 3)
            model.set_reshard_after_backward(mb == 3)
            with hp.CommDebugMode() as comm:
                ((model(xs[mb * 2:(mb + 1) * 2]) - ys[mb * 2:(mb + 1) * 2]).pow(2).mean() / 4).backward()
            rs = comm.get_comm_counts().get("reduce_scatter", 0)
            assert rs == (4 if mb == 3 else 0), (mb, comm.get_comm_counts())
            if raf is False:  # unsharded parameters kept across the micro-batches: one gather in all
                assert comm.get_comm_counts().get("all_gather", 0) == (4 if mb == 0 else 0), (mb, comm.counts)
            if mb < 3:  # nothing reduced yet: the sharded parameters have no gradient
                sharded = [fp.sharded for m in model.modules() if isinstance(m, hp.FSDPModule)
                           for fp in m._hp_fsdp_state.group.params]
                assert len(sharded) == 22 and all(p.grad is None for p in sharded)
        for (n, p), rp in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), rp.grad, **TOL, msg=f"accumulated grad {n} raf={raf}")
    # ---- a no-grad forward (evaluation) leaves every module resharded, the root included
    model = _shard(_make(), mesh)
    with torch.no_grad():
        torch.testing.assert_close(model(x[:2]), ref(x[:2]), **TOL)
    assert all(isinstance(p, hp.DTensor) for p in model.parameters())
    # ---- set_reshard_after_backward(False): kept unsharded parameters are re-gathered after a step
    model = _shard(_make(), mesh, False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.set_reshard_after_backward(False)
    ref2 = _make()
    ref_opt = torch.optim.AdamW(ref2.parameters(), lr=1e-2)
    for s in range(3):
        x2, y2 = _data(10 + s)
        (ref2(x2) - y2).pow(2).mean().backward()
        ref_opt.step(), ref_opt.zero_grad()
        with hp.CommDebugMode() as comm:
            out = model(x2[rank::world])
        assert comm.get_comm_counts().get("all_gather", 0) == 4, comm.get_comm_counts()  # re-gathered each step
        (out - y2[rank::world]).pow(2).mean().backward()
        opt.step(), opt.zero_grad()
    with torch.no_grad(), hp.CommDebugMode() as comm:
        torch.testing.assert_close(model(x2), ref2(x2), **TOL, msg="reshard_after_backward=False")
    assert comm.get_comm_counts() == {"all_gather": 4}, comm.get_comm_counts()  # stale copies re-gathered
    # ---- explicit unshard / reshard
    model = _shard(_make(), mesh)
    h = model.blocks[0].unshard(async_op=True)
    h.wait()
    w = model.blocks[0].w1.weight
    assert not isinstance(w, hp.DTensor) and w.shape == (13, 10)
    torch.testing.assert_close(w.detach(), _make().blocks[0].w1.weight.detach(), rtol=0, atol=0)
    model.blocks[0].reshard()
    assert isinstance(model.blocks[0].w1.weight, hp.DTensor)
    return True


def _ckpt_and_save(tmpdir):
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (world,))
    ref = _make()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = _train(ref, ref_opt, 4)
    # activation checkpointing inside fully_shard-ed blocks
    model = _make()
    for b in model.blocks:
        b.__class__ = CkptBlock
    _shard(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _train(model, opt, 2, rank, world)
    # per-rank torch.save / torch.load of the sharded model and optimizer, then continue in a fresh model
    path = f"{tmpdir}/rank{rank}.pt"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    model2 = _shard(_make(seed=7), mesh)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sd = torch.load(path, weights_only=False)
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    for p in model2.parameters():
        assert isinstance(p, hp.DTensor) and isinstance(opt2.state[p]["exp_avg"], hp.DTensor)
    losses2 = []
    for s in range(2, 4):  # same data schedule as _train's steps 2, 3
        x, y = _data(s)
        n = x.shape[0] // world
        loss = (model2(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]).pow(2).mean()
        loss.backward()
        nn.utils.clip_grad_norm_(model2.parameters(), 0.05)
        opt2.step()
        opt2.zero_grad()
        l = loss.detach().clone()
        dist.all_reduce(l)
        losses2.append(l.item() / world)
    _check_parity(model2, ref, losses + losses2, ref_losses, "checkpointing + save/load")
    return True


def _meta_init():
    """Meta-device model -> fully_shard -> to_empty -> init under hp.manual_seed == the same init unsharded."""
    world = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (world,))

    def init(m):
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                nn.init.zeros_(p) if "norm" not in n else nn.init.constant_(p, 0.1)
            elif "norm" in n:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.02)

    with torch.device("meta"):
        model = Net().to(DT)
    _shard(model, mesh)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    hp.manual_seed(5)
    init(model)
    # reference: the same init on DTensors sharded another way (on dim 0 over a fresh mesh): the
    # layout-independent stream gives every sharding the same values (replicated DTensors would get
    # torch's own draws instead, see docs/ops.md "Random numbers")
    ref = Net().to(DT)

    def shard0(name, mod, m):
        for pn, prm in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(pn, nn.Parameter(hp.distribute_tensor(prm.detach(), m, [hp.Shard(0)])))
    hp.distribute_module(ref, hp.init_device_mesh("cpu", (world,)), shard0)
    hp.manual_seed(5)
    init(ref)
    for (n, p), rp in zip(model.named_parameters(), ref.parameters()):
        assert p._local_tensor.device.type == "cpu"
        torch.testing.assert_close(p.full_tensor(), rp.full_tensor(), rtol=0, atol=0, msg=n)
    # and it trains
    x, y = _data(0)
    (model(x) - y).pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    return True


def _mixed_precision():
    """bf16 params / fp32 reduce: losses equal torch's FSDP2 under the same policy within bf16 tolerance."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP, fully_shard as torch_fully_shard
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (world,))
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    tmesh = torch_mesh("cpu", (world,))
    kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = _make()
    ours.float()
    theirs = copy.deepcopy(ours)
    for b in ours.blocks:
        fully_shard(b, mesh=mesh, mp_policy=MixedPrecisionPolicy(**kw))
    fully_shard(ours, mesh=mesh, mp_policy=MixedPrecisionPolicy(**kw))
    for b in theirs.blocks:
        torch_fully_shard(b, mesh=tmesh, mp_policy=TorchMP(**kw))
    torch_fully_shard(theirs, mesh=tmesh, mp_policy=TorchMP(**kw))
    o1 = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    o2 = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for s in range(5):
        x, y = _data(s)
        x, y = x.float()[rank::world], y.float()[rank::world]
        out1, out2 = ours(x), theirs(x)
        assert out1.dtype == torch.bfloat16 and out2.dtype == torch.bfloat16
        l1 = (out1.float() - y).pow(2).mean()
        l2 = (out2.float() - y).pow(2).mean()
        torch.testing.assert_close(l1, l2, rtol=1e-2, atol=1e-3)
        l1.backward()
        l2.backward()
        for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad._local_tensor, q.grad.to_local(), rtol=2e-2, atol=2e-3, msg=n)
        o1.step(), o2.step(), o1.zero_grad(), o2.zero_grad()
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p._local_tensor, q.to_local(), rtol=2e-2, atol=2e-3, msg=n)
    return True


def _errors():
    world = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (world,))
    m = _make()
    fully_shard(m.blocks[0], mesh=mesh)
    with pytest.raises(RuntimeError, match="already applied to this FSDPBlock"):
        fully_shard(m.blocks[0], mesh=mesh)
    mesh3 = hp.init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("a", "b", "c"))
    with pytest.raises(ValueError, match="3-D mesh"):
        fully_shard(_make().blocks[0], mesh=mesh3)
    with pytest.raises(ValueError, match="ignored_params holds a parameter of shape \\(5, 10\\) that is not"):
        fully_shard(_make().blocks[0], mesh=mesh, ignored_params={_make().head.weight})
    with pytest.raises(ValueError, match="param_dtype=torch.int32 is not a floating dtype"):
        fully_shard(_make().blocks[0], mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int32))
    with pytest.raises(ValueError, match=r"Shard\(1\) for parameter 'norm.weight' of shape \(10,\); expected -1 <= dim < 1"):
        fully_shard(_make().blocks[0], mesh=mesh, shard_placement_fn=lambda p: hp.Shard(p.dim()))
    # every check runs before the module changes: an error on a later parameter leaves the earlier ones
    # (norm.weight, norm.bias) unsharded and the module as it was, so fully_shard can be applied again
    b = _make().blocks[0]
    before = dict(b.named_parameters())
    with pytest.raises(ValueError, match=r"Shard\(2\) for parameter 'w1.weight' of shape \(13, 10\); expected -2 <= dim"):
        fully_shard(b, mesh=mesh, shard_placement_fn=lambda p: hp.Shard(p.dim()) if p.dim() == 2 else None)
    assert type(b) is Block and "_hp_fsdp_state" not in b.__dict__
    assert all(p is before[n] and not isinstance(p, hp.DTensor) and not hasattr(p, "_hp_fsdp_owner")
               for n, p in b.named_parameters())
    fully_shard(b, mesh=mesh)
    assert all(isinstance(p, hp.DTensor) and p.placements == (hp.Shard(0),) for p in b.parameters())
    # a TP parameter on a mesh that is not another dim of the fully_shard mesh's root
    b = _make().blocks[0]
    b.w1.weight = nn.Parameter(hp.distribute_tensor(b.w1.weight.detach(), mesh, [hp.Shard(0)]))
    with pytest.raises(ValueError, match="parameter 'w1.weight' is a DTensor on"):
        fully_shard(b, mesh=hp.init_device_mesh("cpu", (world,)))
    # tied parameters: inside one group they work; across groups: a clear error
    m = _make()
    m.head.weight = nn.Parameter(torch.randn(5, 10, dtype=DT))
    m.blocks[0].w2.bias = m.inp.bias
    fully_shard(m.blocks[0], mesh=mesh)
    with pytest.raises(ValueError, match="parameter 'inp.bias' is tied to a parameter already sharded"):
        fully_shard(m, mesh=mesh)
    # ignored params stay plain and unsharded; a Shard(1) placement works
    m = _make()
    ref = _make()
    fully_shard(m, mesh=mesh, ignored_params={m.head.bias}, shard_placement_fn=lambda p: hp.Shard(p.dim() - 1))
    assert not isinstance(m.head.bias, hp.DTensor)
    assert m.inp.weight.placements == (hp.Shard(1),)
    x, y = _data(0)
    torch.testing.assert_close(m(x), ref(x), **TOL)
    # state_dict() right after forward (the root keeps its parameters unsharded): sharded DTensors
    m = _shard(_make(), mesh)
    m(x)
    assert not isinstance(m.inp.weight, hp.DTensor)
    assert all(isinstance(v, hp.DTensor) for v in m.state_dict().values())
    assert isinstance(m.inp.weight, hp.DTensor)
    # CPUOffloadPolicy: on a CPU-only machine the same numbers as no offload
    from hyper_parallel.fsdp import CPUOffloadPolicy
    a, b = _shard(_make(), mesh), _shard(_make(), mesh, offload_policy=CPUOffloadPolicy())
    la = _train(a, torch.optim.AdamW(a.parameters(), lr=1e-2), 2, dist.get_rank(), world)
    lb = _train(b, torch.optim.AdamW(b.parameters(), lr=1e-2), 2, dist.get_rank(), world)
    assert la == lb and all(p._local_tensor.device.type == "cpu" for p in b.parameters())
    return True


def test_fsdp_prefetch_accumulation_2(dist_runner):
    assert dist_runner.run(2, _prefetch_and_accumulation) == [True] * 2


def test_fsdp_checkpointing_save_load_2(dist_runner, tmp_path):
    assert dist_runner.run(2, _ckpt_and_save, str(tmp_path)) == [True] * 2


def test_fsdp_meta_init_mixed_precision_errors_2(dist_runner):
    assert dist_runner.run(2, _meta_init) == [True] * 2
    assert dist_runner.run(2, _mixed_precision) == [True] * 2
    assert dist_runner.run(2, _errors) == [True] * 2
