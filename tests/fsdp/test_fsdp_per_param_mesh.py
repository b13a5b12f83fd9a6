"""``fully_shard(shard_placement_fn=...)`` returning torch 2.13's ``ShardPlacementResult(placement, mesh_info)``:
MoE experts (DTensors ``Shard(0)`` on the expert-parallel mesh) sharded on the expert-data-parallel mesh,
the block's other parameters on the dp mesh, in ONE ``fully_shard`` call (torchtitan's EP > 1 layout).

The model is run three ways on the same ranks from the same weights, float64, fused AdamW:
one process (the reference), hyper_parallel's ``fully_shard``, torch's own FSDP2 (``fully_shard`` with
torch's ``ShardPlacementResult`` / ``FSDPMeshInfo`` on torch DTensors). The experts' forward is EP by
all_gather: each rank computes its local experts on the tokens of every rank of its EP group, the
contributions are summed over the group (a differentiable all_reduce) and each rank keeps its rows.

Gradients: as torchtitan (``set_gradient_divide_factor(1.0)`` on every FSDP module, the loss scaled
by 1/world) and with ``set_gradient_divide_factor(world)``, the trained weights and the losses equal
one process. With torch's default (each parameter group divides by its own mesh's size: the experts'
gradients, already summed over the EP group, by the efsdp size only) the result differs from one
process, and hyper_parallel must equal torch's FSDP2 there too.
"""
from __future__ import annotations

import pytest

D, H, E, N = 6, 5, 4, 3  # model dim, expert hidden, experts, tokens per rank


def _ep_fns():
    """Differentiable all_gather (tokens to the EP group) and all_reduce (sum of expert outputs), gloo-only ops."""
    import torch
    import torch.distributed as dist

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            k = dist.get_world_size(group)
            out = x.new_empty((k * x.shape[0],) + tuple(x.shape[1:]))
            dist.all_gather_into_tensor(out, x.contiguous(), group=group)
            return out

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous().clone()
            dist.all_reduce(g, group=ctx.group)
            k, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
            return g.chunk(k)[r].clone(), None

    class Sum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            x = x.clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            dist.all_reduce(g, group=ctx.group)
            return g, None
    return Gather.apply, Sum.apply


def _model(weights, ep_group=None):
    """Two blocks (dense ``a``, router ``g``, experts ``experts.w``) and a dense head."""
    import torch

    gather, total = _ep_fns() if ep_group is not None else (None, None)

    class Experts(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = torch.nn.Parameter(w)

        def forward(self, h, gates):
            w = self.w
            if ep_group is None:  # one process: every expert on every token
                return torch.einsum("te,ted->td", gates, torch.tanh(torch.einsum("td,edh->teh", h, w)) @ w.new_ones(H, D))
            import torch.distributed as dist
            w = w.to_local()  # this EP rank's experts (unsharded by FSDP: the full rows of each)
            k, r = dist.get_world_size(ep_group), dist.get_rank(ep_group)
            e0 = r * w.shape[0]
            hh, gg = gather(h, ep_group), gather(gates, ep_group)
            part = torch.einsum("te,ted->td", gg[:, e0:e0 + w.shape[0]],
                                torch.tanh(torch.einsum("td,edh->teh", hh, w)) @ w.new_ones(H, D))
            return total(part, ep_group).chunk(k)[r]

    class Block(torch.nn.Module):
        def __init__(self, a, g, w):
            super().__init__()
            self.a = torch.nn.Parameter(a)
            self.g = torch.nn.Parameter(g)
            self.experts = Experts(w)

        def forward(self, x):
            h = torch.tanh(x @ self.a)
            gates = torch.softmax(h @ self.g, dim=-1)
            return x + self.experts(h, gates)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(*weights[3 * i: 3 * i + 3]) for i in range(2)])
            self.head = torch.nn.Parameter(weights[6])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x @ self.head
    return Model()


def _weights():
    import torch
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 0.5
    return [r(D, D), r(D, E), r(E, D, H), r(D, D), r(D, E), r(E, D, H), r(D, 2)]


def _batches(ws, steps=3):
    import torch
    g = torch.Generator().manual_seed(1)
    return [torch.randn(ws * N, D, generator=g, dtype=torch.float64) for _ in range(steps)]


def _train(model, params, batches, rank=None, ws=None, scale=1.0):
    """``scale`` multiplies the loss backward sees (torchtitan divides by the global token count)."""
    import torch
    # eps large enough that the update depends on the gradient's scale (with eps=1e-8 Adam's first
    # steps are nearly lr * sign(grad) and a gradient off by 2x would move the weights by ~1e-8 only)
    opt = torch.optim.AdamW(params, lr=0.05, eps=0.1, weight_decay=0.01, fused=True)
    losses = []
    for xb in batches:
        x = xb if rank is None else xb.chunk(ws)[rank]
        loss = (model(x) ** 2).mean()
        (loss * scale if scale != 1.0 else loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _distributed(stack, ep, divide, expert_dim, torch_objects=False, scale=1.0, hsdp=False):
    """Train under ``stack`` ("hp" or "torch") fully_shard; return (mean losses, full weights, expert mesh names).

    ``hsdp``: the experts' mesh_info is HSDP (``HSDPMeshInfo`` on ``(erep, efsdp)``: replicated over
    ``erep``, sharded over ``efsdp``), as torchtitan's with a ``dp_replicate`` dim."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    ws, rank = dist.get_world_size(), dist.get_rank()
    world = init_device_mesh("cpu", (ws,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (ws,), ("fsdp",))
    if hsdp:
        sparse = world._unflatten(0, (2, ws // ep // 2, ep), ("erep", "efsdp", "ep"))
    else:
        sparse = world._unflatten(0, (ws // ep, ep), ("efsdp", "ep"))
    if stack == "hp" and not torch_objects:
        import hyper_parallel as hp
        from hyper_parallel.fsdp import (FSDPMeshInfo, FSDPModule, HSDPMeshInfo, ShardPlacementResult, fully_shard,
                                         get_mesh_info)
        Shard, distribute = hp.Shard, hp.distribute_tensor
    else:
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info as get_mesh_info
        from torch.distributed.tensor import Shard, distribute_tensor as distribute
        if stack == "hp":  # hyper_parallel's fully_shard given torch's objects (no swap)
            import hyper_parallel as hp
            from hyper_parallel.fsdp import FSDPModule, fully_shard
            distribute = lambda t, m, pl: hp.distribute_tensor(t, m, [hp.Shard(0)])
        else:
            from torch.distributed.fsdp import FSDPModule, fully_shard
    w = _weights()
    ep_mesh = sparse["ep"]
    for i in (2, 5):
        w[i] = distribute(w[i], ep_mesh, [Shard(0)])
    model = _model(w, ep_group=ep_mesh.get_group())
    if hsdp:
        edp_info = HSDPMeshInfo(sparse["erep", "efsdp"], shard_mesh_dim=1, replicate_mesh_dim=0)
    else:
        edp_info = FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0)
    dp_info = get_mesh_info(dense["fsdp"])
    for b in model.blocks:
        experts = set(b.experts.parameters())

        def fn(p, experts=experts):
            if p in experts:
                return ShardPlacementResult(placement=Shard(expert_dim), mesh_info=edp_info)
            return ShardPlacementResult(placement=Shard(0), mesh_info=dp_info)
        fully_shard(b, mesh=dense["fsdp"], shard_placement_fn=fn)
    fully_shard(model, mesh=dense["fsdp"])
    if divide is not None:  # as torchtitan's disable_fsdp_gradient_division: on every FSDP module
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(float(divide))
    losses = _train(model, model.parameters(), _batches(ws), rank, ws, scale)
    out = []
    for l in losses:
        t = torch.tensor([l], dtype=torch.float64)
        dist.all_reduce(t)
        out.append(t.item() / ws)
    return out, [_full(p.detach()).clone() for p in model.parameters()], tuple(
        tuple(model.blocks[0].experts.w.device_mesh.mesh_dim_names))


def _body(ep, expert_dim, hsdp=False):
    import torch
    import torch.distributed as dist
    ws = dist.get_world_size()
    ref = _model([t.clone() for t in _weights()])
    ref_losses = _train(ref, ref.parameters(), _batches(ws))
    ref_w = [p.detach() for p in ref.parameters()]
    # torchtitan's way: no division by FSDP (factor 1 on every FSDP module), the loss scaled by 1/world
    # instead; hyper_parallel (with its own and with torch's ShardPlacementResult/FSDPMeshInfo) and
    # torch's FSDP2 all equal one process
    runs = [("hp", False, 1.0, 1.0 / ws), ("hp", True, 1.0, 1.0 / ws), ("torch", True, 1.0, 1.0 / ws),
            # one factor for every group: sum over the world / world (torch's FSDP2 divides a size-1
            # group's float64 gradients twice by a custom factor, pre-divide and copy, so not run there)
            ("hp", False, float(ws), 1.0)]
    for stack, objs, divide, scale in runs:
        losses, weights, names = _distributed(stack, ep, divide, expert_dim, torch_objects=objs, scale=scale,
                                              hsdp=hsdp)
        what = f"{stack} (torch objects {objs}, divide {divide})"
        assert names == (("erep", "efsdp", "ep") if hsdp else ("efsdp", "ep")), names
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-12, atol=1e-12,
                                   msg=f"{what} losses")
        for i, (a, b) in enumerate(zip(weights, ref_w)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"{what} parameter {i}")
    # torch's default: each group divides by its own mesh's size; hyper_parallel equals torch's FSDP2
    hp_losses, hp_w, _ = _distributed("hp", ep, None, expert_dim, hsdp=hsdp)
    th_losses, th_w, _ = _distributed("torch", ep, None, expert_dim, hsdp=hsdp)
    torch.testing.assert_close(torch.tensor(hp_losses), torch.tensor(th_losses), rtol=1e-12, atol=1e-12)
    for i, (a, b) in enumerate(zip(hp_w, th_w)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"default divide, parameter {i}")
    if ep > 1:  # the per-mesh default really differs from one process (the test can tell them apart)
        assert max(abs(a - b).max().item() for a, b in zip(hp_w, ref_w)) > 1e-4
    return True


@pytest.mark.parametrize("ws,ep,expert_dim,hsdp", [(2, 2, 0, False), (4, 2, 0, False), (4, 2, 1, False),
                                                    (4, 2, 0, True)])
def test_experts_on_another_dp_mesh(dist_runner, ws, ep, expert_dim, hsdp):
    assert dist_runner.run(ws, _body, ep, expert_dim, hsdp, timeout=300) == [True] * ws


def _bad_input_body():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import hyper_parallel as hp
    from hyper_parallel.fsdp import DDPMeshInfo, FSDPMeshInfo, ShardPlacementResult, fully_shard
    ws = dist.get_world_size()
    world = init_device_mesh("cpu", (ws,), mesh_dim_names=("world",))
    sparse = world._unflatten(0, (1, ws), ("efsdp", "ep"))
    dense = world._unflatten(0, (ws,), ("fsdp",))

    def lin():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 4, bias=False).double()

    info = FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0)
    from torch.distributed.tensor.placement_types import _StridedShard
    with pytest.raises(ValueError, match=r"placement=_StridedShard.*expected Shard\(dim\) or None"):
        fully_shard(lin(), mesh=dense["fsdp"],
                    shard_placement_fn=lambda p: ShardPlacementResult(_StridedShard(0, split_factor=2), info))
    with pytest.raises(ValueError, match=r"placement=Replicate\(\).*expected Shard\(dim\) or None"):
        fully_shard(lin(), mesh=dense["fsdp"], shard_placement_fn=lambda p: ShardPlacementResult(hp.Replicate(), info))
    with pytest.raises(ValueError, match="mesh_info is DDPMeshInfo.*expected an FSDPMeshInfo"):
        ddp = DDPMeshInfo(dense["fsdp"], replicate_mesh_dim=0)
        fully_shard(lin(), mesh=dense["fsdp"], shard_placement_fn=lambda p: ShardPlacementResult(hp.Shard(0), ddp))
    with pytest.raises(ValueError, match="returned 3 for parameter 'weight'; expected Shard"):
        fully_shard(lin(), mesh=dense["fsdp"], shard_placement_fn=lambda p: 3)
    # a 2-D mesh given as FSDPMeshInfo (not HSDP's replicate 0 / shard 1)
    two_d = FSDPMeshInfo(sparse, shard_mesh_dim=1)
    with pytest.raises(ValueError, match=r"FSDPMeshInfo\(mesh=.*shard_mesh_dim=1.*is not supported; expected"):
        fully_shard(lin(), mesh=dense["fsdp"], shard_placement_fn=lambda p: ShardPlacementResult(hp.Shard(0), two_d))
    # a DTensor on the ep mesh of one root, FSDP mesh_info of another root: not a sibling dim
    other = init_device_mesh("cpu", (ws,), mesh_dim_names=("other",))
    m = lin()
    m.weight = torch.nn.Parameter(hp.distribute_tensor(m.weight.detach(), sparse["ep"], [hp.Shard(0)]))
    bad = FSDPMeshInfo(other, shard_mesh_dim=0)
    with pytest.raises(ValueError, match="must be another dim of the same root mesh"):
        fully_shard(m, mesh=dense["fsdp"], shard_placement_fn=lambda p: ShardPlacementResult(hp.Shard(0), bad))
    # the rejected calls left the modules untouched: no FSDP state
    assert not isinstance(m, hp.FSDPModule) and not isinstance(m.weight, type(None))
    return True


def test_bad_shard_placement_results(dist_runner):
    assert dist_runner.run(2, _bad_input_body, timeout=120) == [True, True]


def _mesh_outside_world_body():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel import Shard
    from hyper_parallel.dtensor.device_mesh import DeviceMesh
    from hyper_parallel.fsdp import FSDPMeshInfo, ShardPlacementResult, fully_shard
    ws = dist.get_world_size()
    world = init_device_mesh("cpu", (ws,), mesh_dim_names=("world",))
    info = FSDPMeshInfo(world._unflatten(0, (ws // 2, 2), ("a", "b"))["b"], shard_mesh_dim=0)
    # fully_shard's mesh: a root of its own over half the ranks; mesh_info's: a slice of the 4-rank world
    half = DeviceMesh("cpu", [0, 1], mesh_dim_names=("half",))
    m = torch.nn.Linear(4, 4, bias=False).double()
    with pytest.raises(ValueError, match="is not a sub-mesh of the root"):
        fully_shard(m, mesh=half, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), info))
    return True


def test_mesh_info_of_another_world(dist_runner):
    assert dist_runner.run(4, _mesh_outside_world_body, timeout=120) == [True] * 4
