"""HyperParallel's gradient and mesh semantics on its own entry points (issue 24, classes 1 and 2).

Programs here are written the HyperParallel way (its module paths, ``Layout``, ``hsdp``,
``reduce_partial``, ``loss.backward(1 / loss.layout.repeat_num())``, ``SkipDTensorDispatch``
around the optimizer) and must reach the single-process losses and parameters with no
change and no environment variable; HyperParallel's ``init_device_mesh`` gives each aligned
block of ranks its own mesh, PyTorch's (``hyper_parallel.device_mesh``) keeps ranks 0..n-1.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor, SkipDTensorDispatch
from hyper_parallel.core.dtensor.layout import Layout
from hyper_parallel.core.dtensor.device_mesh import init_device_mesh, uses_hp_semantics
from hyper_parallel.core.dtensor.placement_types import Shard, Replicate
from hyper_parallel.core.hsdp import hsdp

STEPS = 10
TOL = dict(rtol=1e-10, atol=1e-12)
# name -> (mesh shape, mesh dim names, input alias, weight alias)
LAYOUTS = {
    "1d_dp": ((4,), ("dp",), ("dp", "None"), ("None", "None")),
    "1d_tp": ((4,), ("tp",), ("None", "tp"), ("None", "tp")),
    "2d_dp_tp": ((2, 2), ("dp", "tp"), ("dp", "tp"), ("None", "tp")),
    "2d_issue_4x2": ((4, 2), ("dp", "tp"), ("dp", "tp"), ("None", "tp")),
}


class Net(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8, dtype=torch.float64) * 0.3)
        self.b = nn.Parameter(torch.randn(16, dtype=torch.float64) * 0.3) if bias else None

    def forward(self, x):
        out = F.linear(x, self.w, self.b)
        if isinstance(out, DTensor):
            out = out.reduce_partial()
        return F.relu(out).sum()


def _optim(params, kind):
    return torch.optim.SGD(params, lr=0.01) if kind == "sgd" else torch.optim.AdamW(params, lr=0.01)


def _train_hp_way(layout_name):
    shape, names, x_alias, w_alias = LAYOUTS[layout_name]
    layout = Layout(shape, names)
    out = []
    for bias in (False, True):
        for kind in ("sgd", "adamw"):
            torch.manual_seed(0)
            ref = Net(bias)
            x = torch.randn(8, 8, dtype=torch.float64)
            net = Net(bias)
            net.load_state_dict(ref.state_dict())
            net.w = nn.Parameter(distribute_tensor(net.w.data, layout.mesh, layout(*w_alias)))
            if bias:
                net.b = nn.Parameter(distribute_tensor(net.b.data, layout.mesh, layout("None",)))
            net = hsdp(net)
            xd = distribute_tensor(x, layout.mesh, layout(*x_alias))
            opt, ref_opt = _optim(net.parameters(), kind), _optim(ref.parameters(), kind)
            for step in range(STEPS):
                loss = net(xd)
                loss = loss.reduce_partial()
                loss.backward(torch.tensor(1.0 / loss.layout.repeat_num(), dtype=torch.float64))
                with SkipDTensorDispatch():
                    opt.step()
                    opt.zero_grad()
                ref_loss = ref(x)
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                torch.testing.assert_close(loss.to_local().detach(), ref_loss.detach(), **TOL,
                                           msg=f"{layout_name} bias={bias} {kind} step {step} loss")
            torch.testing.assert_close(net.w.full_tensor(), ref.w.detach(), **TOL)
            if bias:
                torch.testing.assert_close(net.b.full_tensor(), ref.b.detach(), **TOL)
            out.append(float(ref_loss))
    return out


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_hyperparallel_training_program_matches_one_process(dist_runner, layout_name):
    n = 1
    for s in LAYOUTS[layout_name][0]:
        n *= s
    res = dist_runner.run(n, _train_hp_way, layout_name)
    assert all(r == res[0] for r in res)


def _hsdp_plain(threshold, level):
    """hsdp on plain parameters: every rank's gradient summed (HyperParallel), times grad_scale."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    x = torch.randn(4 * world, 8, dtype=torch.float64)
    results = []
    for grad_scale in (1.0, 0.25):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
        model.load_state_dict(ref.state_dict())
        hsdp(model, threshold=threshold, optimizer_level=level, grad_scale=grad_scale)
        # each rank's loss is a sum over its own rows: summed gradients = the whole batch's
        model(x[rank * 4:(rank + 1) * 4]).pow(2).sum().backward()
        ref.zero_grad()
        (ref(x).pow(2).sum() * grad_scale).backward()
        for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(g, rp.grad, **TOL, msg=f"threshold={threshold} {level} {name}")
        results.append(True)
    return results


@pytest.mark.parametrize("threshold,level", [(64, "level1"), (0, "level1"), (0, "level2"), (0, "level3")])
def test_hsdp_sums_gradients_then_scales(dist_runner, threshold, level):
    assert dist_runner.run(2, _hsdp_plain, threshold, level) == [[True, True]] * 2


def _mesh_blocks():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    block = rank // 4
    assert mesh.rank_list == tuple(range(4 * block, 4 * block + 4)) and uses_hp_semantics(mesh)
    assert mesh.get_coordinate() == [divmod(rank % 4, 2)[0], rank % 2] or \
        tuple(mesh.get_coordinate()) == divmod(rank % 4, 2)
    assert uses_hp_semantics(mesh["tp"])
    # each block computes on its own data, independently and correctly
    torch.manual_seed(block)
    x = torch.randn(6, 5, dtype=torch.float64)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    xd = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    wd = distribute_tensor(w.detach(), mesh, [Replicate(), Shard(0)]).requires_grad_()
    y = (xd @ wd).tanh().sum()
    ref = (x @ w).tanh().sum()
    torch.testing.assert_close(y.full_tensor(), ref.detach(), **TOL)
    y.full_tensor().backward()
    ref.backward()
    torch.testing.assert_close(wd.grad.full_tensor(), w.grad, **TOL)
    # an explicit rank_list: exactly those ranks, the others are outside
    explicit = init_device_mesh("cpu", (2,), rank_list=[5, 2])
    assert explicit.rank_list == (5, 2)
    assert explicit.get_coordinate() == ({5: [0], 2: [1]}.get(rank)) or \
        (explicit.get_coordinate() is None) == (rank not in (5, 2))
    # PyTorch's init_device_mesh (the mirrored path) keeps PyTorch's semantics: ranks 0..3, 4..7 off-mesh
    import hyper_parallel.device_mesh as torch_style
    tmesh = torch_style.init_device_mesh("cpu", (2, 2))
    assert tmesh.rank_list == (0, 1, 2, 3) and not uses_hp_semantics(tmesh)
    assert (tmesh.get_coordinate() is None) == (rank >= 4)
    # bad input: a mesh size that does not divide the world, a bad rank_list
    with pytest.raises(ValueError, match=r"mesh_shape \(3,\) has 3 devices, which does not divide the world size 8"):
        init_device_mesh("cpu", (3,))
    with pytest.raises(ValueError, match=r"rank_list \[0, 0\] must hold 2 distinct ranks in \[0, 8\)"):
        init_device_mesh("cpu", (2,), rank_list=[0, 0])
    return True


def test_init_device_mesh_blocks_and_rank_list(dist_runner):
    assert dist_runner.run(8, _mesh_blocks) == [True] * 8


def _seed_conventions():
    """A plain backward gradient: each rank's share on HyperParallel meshes, the whole one on PyTorch's."""
    import hyper_parallel.device_mesh as torch_style
    world = dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64)
    w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    (x @ w).pow(2).sum().backward()
    for mesh, seed in ((init_device_mesh("cpu", (world,)), 1.0 / world),
                       (torch_style.init_device_mesh("cpu", (world,)), 1.0)):
        wd = distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_()
        loss = (distribute_tensor(x, mesh, [Shard(0)]) @ wd).pow(2).sum().reduce_partial()
        assert loss.placements == (Replicate(),)
        loss.backward(torch.tensor(seed, dtype=torch.float64))
        torch.testing.assert_close(wd.grad.full_tensor(), w.grad, **TOL, msg=f"hp={uses_hp_semantics(mesh)} {(wd.grad.full_tensor() / w.grad).flatten().tolist()} {wd.grad.placements}")
    return True


def test_plain_backward_seed_follows_the_mesh_semantics(dist_runner):
    assert dist_runner.run(2, _seed_conventions) == [True] * 2


def _redistribute_to_layout():
    """HyperParallel's ``x.redistribute(dst_layout)``: one tensor Layout gives mesh and placements."""
    layout = Layout((2,), ("dp",))
    x = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    d = distribute_tensor(x, layout.mesh, layout("dp", "None"))
    y = d.redistribute(layout("None", "dp"))
    assert y.placements == (Shard(1),) and y.device_mesh == layout.mesh
    torch.testing.assert_close(y.full_tensor(), x)
    p = distribute_tensor(x, layout.mesh, layout("dp", "None")).sum(0)   # Partial(sum) over dp
    r = p.redistribute(layout("None",))
    assert r.placements == (Replicate(),)
    torch.testing.assert_close(r.to_local(), x.sum(0))
    with pytest.raises(TypeError, match="already carries the placements"):
        d.redistribute(layout("None", "dp"), [Replicate()])
    with pytest.raises(ValueError, match="device-matrix Layout has no tensor map"):
        d.redistribute(layout)
    return True


def test_redistribute_to_a_layout(dist_runner):
    assert dist_runner.run(2, _redistribute_to_layout) == [True] * 2


def _base_shard_program():
    """HyperParallel's own base_shard program (tests/compat/hp_base_shard.py) with its assertions, then ours."""
    import numpy as np
    from tests.compat.hp_base_shard import SimpleModel, mse_loss_sum, test_base_shard
    rank = dist.get_rank()
    ref_loss, dist_loss, ref_slice, dist_grad, dist_model = test_base_shard()   # HyperParallel's asserts, 1e-3
    assert uses_hp_semantics(dist_loss.device_mesh) and dist_loss.layout.repeat_num() == 8
    # the gradient: a DTensor laid out like the weight; .cpu() keeps it a DTensor, .numpy() is the piece
    assert isinstance(dist_grad, DTensor) and dist_grad.placements == (Replicate(), Shard(1))
    moved = dist_grad.cpu()
    assert isinstance(moved, DTensor) and moved.placements == dist_grad.placements
    piece = dist_grad.to_local()
    assert dist_grad.cpu().detach().numpy().shape == (8, 1) and np.asarray(moved).shape == (8, 1)
    np.testing.assert_array_equal(dist_grad.cpu().detach().numpy(), piece.numpy())
    # tighter than the program's 1e-3: the same float32 computation as one process
    torch.testing.assert_close(piece, ref_slice, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dist_loss.to_local(), ref_loss, rtol=1e-6, atol=1e-4)
    # the weights after 2 SGD steps: this rank's column of one process's weights
    torch.manual_seed(1)
    ref_model = SimpleModel()
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.01)
    torch.manual_seed(2)
    x = torch.randn(32, 8)
    torch.manual_seed(3)
    y = torch.randn(32, 8)
    for _ in range(2):
        mse_loss_sum(ref_model(x), y).backward()
        opt.step()
        opt.zero_grad()
    w = dist_model.weight
    torch.testing.assert_close(w.to_local(), ref_model.weight.detach()[:, rank:rank + 1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.full_tensor(), ref_model.weight.detach(), rtol=1e-5, atol=1e-5)
    return True


def test_hyperparallel_base_shard_program(dist_runner):
    """HyperParallel's base_shard program ((1, 8) ("dp", "tp") mesh, shard_module, repeat_num seed) on 8 ranks."""
    assert dist_runner.run(8, _base_shard_program, timeout=300) == [True] * 8
