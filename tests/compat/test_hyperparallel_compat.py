"""HyperParallel programs run unchanged: written from HyperParallel's documented usage.

Everything is imported through HyperParallel's module paths (``hyper_parallel.core.dtensor.dtensor``,
``...layout``, ``...shard.api``...), never through our top-level package, except in the
test that checks those paths re-export our objects rather than copies. The distributed
part runs on 8 ranks with a (2, 4) and a (2, 2, 2) mesh: Layout building and queries,
``distribute_tensor`` / ``from_local`` with alias layouts, ``shard_module`` training with
SGD against one process (values of the loss, gradients and parameters after 3 steps),
``SkipDTensorDispatch`` around the optimizer, ``DFunction`` with a HyperParallel-style rule,
and the errors for a plan key that matches nothing and a layout that does not fit the world.
"""
import pytest
import torch
from torch import nn

from hyper_parallel.core.dtensor.dtensor import (
    DTensor, distribute_tensor, distribute_module, ones, empty, full, zeros, SkipDTensorDispatch, _build_layout)
from hyper_parallel.core.dtensor.placement_types import Placement, Shard, Replicate, Partial
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.dtensor.layout import Layout
from hyper_parallel.core.dtensor import random as hp_random
from hyper_parallel.core.tensor_parallel.style import ColwiseParallel, RowwiseParallel, ParallelStyle
from hyper_parallel.core.shard.dfunction import DFunction
from hyper_parallel.core.shard.api import shard_module
from hyper_parallel.core.shard.sharding_plan import ShardingPlan
from hyper_parallel.core.shard.ops.parallel_ops import DistributedOp
from hyper_parallel.core.shard.ops.parallel_ops_register import register_distributed_op, get_distributed_op


# ----------------------------------------------------------------------------- no processes
def test_module_paths_reexport_the_same_objects():
    import hyper_parallel as hp
    from hyper_parallel.core.dtensor import layout as layout_mod
    from hyper_parallel.core.tensor_parallel import style
    from hyper_parallel.core.shard import api as shard_api, sharding_plan, dfunction
    assert DTensor is hp.DTensor and distribute_tensor is hp.distribute_tensor
    assert distribute_module is hp.distribute_module
    assert (ones, empty, full, zeros) == (hp.ones, hp.empty, hp.full, hp.zeros)
    assert SkipDTensorDispatch is hp.SkipDTensorDispatch and DFunction is hp.DFunction
    assert DistributedOp is hp.DistributedOp and layout_mod.DeviceMesh is DeviceMesh is hp.DeviceMesh
    assert Layout is hp.Layout and init_device_mesh is hp.init_device_mesh
    assert (Placement, Shard, Replicate, Partial) == (hp.Placement, hp.Shard, hp.Replicate, hp.Partial)
    assert hp_random.manual_seed is hp.manual_seed and hp_random.is_rng_supported_mesh()
    assert style.ColwiseParallel is ColwiseParallel is hp.ColwiseParallel and RowwiseParallel is hp.RowwiseParallel
    assert ParallelStyle is hp.ParallelStyle and dfunction.DFunction is DFunction
    assert shard_api.shard_module is shard_module is hp.shard_module
    assert sharding_plan.ShardingPlan is ShardingPlan is hp.ShardingPlan
    plan = ShardingPlan(plan={"w": ("None", "tp")})
    assert plan.input_plan is None and plan.output_plan is None and plan.return_local_tensor is None


def test_layout_queries_hyperparallel_convention():
    layout = Layout((2, 4), ("dp", "tp"))
    assert layout.mesh_shape == (2, 4) and layout.alias_name == ("dp", "tp")
    assert layout.rank_list == tuple(range(8)) and layout.tensor_map is None
    x = layout("dp", "None")
    assert x.tensor_map == (1, -1) and x.alias_tensor_map == ("dp", "None")
    assert x.repeat_num() == 4 and not x.is_partial()
    assert layout("None", "tp").tensor_map == (-1, 0) and layout("None", "tp").repeat_num() == 2
    assert layout(("dp", "tp"), "None").tensor_map == ((1, 0), -1)
    assert layout(("dp", "tp"), "None").repeat_num() == 1 and layout("None", "None").repeat_num() == 8
    assert x.to_dict() == {"mesh_shape": (2, 4), "tensor_map": (1, -1), "interleaved_parallel": False,
                           "alias_name": ("dp", "tp"), "rank_list": tuple(range(8))}
    assert x.get_global_shape((3, 5)) == (6, 5)
    assert layout(("dp", "tp"), "None").get_global_shape((2, 5)) == (16, 5)
    assert x.placements == (Shard(0), Replicate())
    assert x.placement_to_tensor_map(3) == [1, -1, -1]
    # HyperParallel mutates; ours returns a new layout and leaves the original alone
    y = x.set_placements([Replicate(), Shard(1)])
    assert y.tensor_map == (-1, 0) and x.tensor_map == (1, -1)
    p = x.with_placements([Shard(0), Partial("max")], 2)
    assert p.is_partial() and p.get_partial_by_dev_id("tp") == "max" and p.get_partial_by_dev_id("dp") is None
    assert x.set_partial_by_dev_axis("tp", "max") == p and not x.is_partial()
    with pytest.raises(ValueError, match="shards the tensor"):
        x.set_partial_by_dev_axis("dp", "sum")
    q = p.reset_partial()
    assert not q.is_partial() and q == x and p.is_partial()
    assert x.get_devices_for_axis("tp", 5) == [4, 5, 6, 7] and x.get_devices_for_axis("dp", 5) == [1, 5]
    # the placement call form: placements on the mesh, tensor rank not known yet
    spec = layout([Shard(0), Replicate()])
    assert spec.tensor_map is None and spec.placements == (Shard(0), Replicate()) and not spec.is_partial()
    assert spec.placement_to_tensor_map(3) == [1, -1, -1] and spec.to_layout(2) == x
    assert layout(Replicate(), Shard(1)).placement_to_tensor_map(2) == [-1, 0]
    assert layout((Partial(), Shard(0))).is_partial() and list(spec) == [Shard(0), Replicate()]
    # 3-d device matrix
    l3 = Layout((2, 2, 2), ("dp", "sp", "tp"))
    z = l3(("dp", "sp"), "None", "tp")
    assert z.tensor_map == ((2, 1), -1, 0) and z.repeat_num() == 1
    assert l3("sp", "None").repeat_num() == 4 and l3("sp", "None").tensor_map == (1, -1)
    assert z.get_global_shape((1, 3, 2)) == (4, 3, 4)
    kw = Layout(mesh_shape=(2, 4), alias_name=("dp", "tp"), rank_list=[7, 6, 5, 4, 3, 2, 1, 0])
    assert kw.rank_list == (7, 6, 5, 4, 3, 2, 1, 0) and kw.alias_name == ("dp", "tp")
    # placements shorter than the mesh are padded with Replicate; extra Replicate ignored; extra Shard raises
    assert _build_layout.__name__ == "_build_layout"
    with pytest.raises(ValueError, match="alias 'pp'"):
        layout("pp", "None")
    with pytest.raises(ValueError, match="no tensor map"):
        layout.to_dict()


def test_unit_repeat_num_is_a_deprecated_no_op():
    from hyper_parallel.core.dtensor.layout import unit_repeat_num
    lay = Layout((2, 4), ("dp", "tp"))("dp", "None")
    assert lay.repeat_num() == 4
    with pytest.warns(DeprecationWarning, match="no effect"):
        unit_repeat_num(True)
    assert lay.repeat_num() == 4       # the 1 / repeat_num() seed is HyperParallel's convention, kept


# ----------------------------------------------------------------------------- distributed bodies
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SimpleModel(nn.Module):
    """HyperParallel's README example: one root-level ``weight``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(12, 6, dtype=torch.float64))

    def forward(self, x):
        return torch.relu(x @ self.weight)


class TwoInTwoOut(nn.Module):
    def forward(self, x, scale=None):
        return x * 2, scale + 1


class ScaleByTwoRule(DistributedOp):
    """HyperParallel style: name in ``__init__``, a one-element tuple of output layouts."""

    def __init__(self):
        super().__init__("HPCompatScaleByTwo")

    def infer_layout(self, layouts, extra_args=None):
        return (layouts[0],)


ScaleByTwoRule()


class ScaleByTwo(DFunction):
    _op_name = "HPCompatScaleByTwo"

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def _reference(x, y, steps, lr):
    torch.manual_seed(0)
    ref = MLP().double()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    losses, grads = [], None
    for i in range(steps):
        opt.zero_grad()
        loss = ((ref(x) - y) ** 2).mean()
        loss.backward()
        losses.append(loss.detach())
        if i == 0:
            grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
        opt.step()
    return ref, losses, grads


def _train_and_compare(mesh, plan, x_spec, x, y, return_local):
    steps, lr = 3, 0.1
    ref, ref_losses, ref_grads = _reference(x, y, steps, lr)
    torch.manual_seed(0)
    model = shard_module(MLP().double(), mesh, plan)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dx = distribute_tensor(x, mesh, x_spec)
    dy = distribute_tensor(y, mesh, x_spec)
    n = x.shape[0] * y.shape[1]
    for i in range(steps):
        opt.zero_grad()
        out = model(dx)
        if return_local:
            assert type(out) is torch.Tensor
            loss = ((out - dy.to_local()) ** 2).sum() / n      # local part of the global mean
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            total = total / mesh.size(2)                       # the tp replicas hold the same part
        else:
            assert isinstance(out, DTensor) and out.placements[0] == Shard(0)
            loss = ((out - dy) ** 2).mean()
            total = loss.full_tensor()
        loss.backward()
        torch.testing.assert_close(total, ref_losses[i], rtol=1e-12, atol=1e-12)
        if i == 0:
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.grad.full_tensor(), ref_grads[k], rtol=1e-10, atol=1e-12)
        with SkipDTensorDispatch():                # HyperParallel: the optimizer runs on local tensors
            opt.step()
    for (k, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert isinstance(p, DTensor), k
        torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-10, atol=1e-12)
    return model


def _compat_8_ranks():
    rank = torch.distributed.get_rank()
    # ---------------------------------------------------------------- (2, 4): standalone Layout and its mesh
    layout = Layout((2, 4), ("dp", "tp"))
    mesh = layout.mesh
    assert isinstance(mesh, DeviceMesh) and mesh.rank == rank and mesh.mesh_shape == (2, 4)
    assert layout("dp", "None").mesh is mesh and mesh.mesh_dim_names == ("dp", "tp")
    assert mesh.rank_list == tuple(range(8)) and mesh.ndim == 2 and mesh.shape == (2, 4)
    assert mesh.get_device_num_along_axis("tp") == 4 and mesh.axis_index("tp") == 1 and mesh.axis_id("dp") == 1
    assert mesh.get_rank_list_along_axis("tp") == [rank // 4 * 4 + i for i in range(4)]
    assert mesh.get_local_rank("tp") == rank % 4 and mesh.get_coordinate() == (rank // 4, rank % 4)
    assert mesh.get_global_shape((3, 5), (1, -1)) == (6, 5) and mesh.root_mesh is None
    assert mesh["tp"].root_mesh is mesh
    assert torch.distributed.get_process_group_ranks(mesh.get_comm_group_by_axis("dp")) == [rank % 4, rank % 4 + 4]
    torch.manual_seed(1)
    g = torch.randn(8, 12, dtype=torch.float64)
    x_layout = layout("dp", "tp")
    dt = distribute_tensor(g, x_layout.mesh, x_layout.alias_placements)
    assert dt.placements == (Shard(0), Shard(1)) and dt.to_local().shape == (4, 3)
    torch.testing.assert_close(dt.to_local(), g[rank // 4 * 4:rank // 4 * 4 + 4, rank % 4 * 3:rank % 4 * 3 + 3])
    assert dt.layout.tensor_map == (1, 0) and dt.layout.repeat_num() == 1
    assert dt.layout.get_global_shape(dt.to_local().shape) == (8, 12)
    # from_local with an alias layout over two mesh dims; differentiable
    local = g.reshape(8, 12)[rank:rank + 1].clone().requires_grad_()
    fl = DTensor.from_local(local, mesh, (("dp", "tp"), "None"))
    assert fl.shape == (8, 12) and fl.layout.tensor_map == ((1, 0), -1)
    torch.testing.assert_close(fl.full_tensor(), g)
    (fl.full_tensor() * 3).sum().backward()
    torch.testing.assert_close(local.grad, torch.full((1, 12), 3.0, dtype=torch.float64))
    spec = layout([Shard(1), Replicate()])                  # HyperParallel's placement call form
    ds = distribute_tensor(g, spec.mesh, spec)
    assert ds.placements == (Shard(1), Replicate()) and ds.to_local().shape == (8, 6)
    assert dt.redistribute(mesh, spec).placements == (Shard(1), Replicate())
    r = dt.redistribute(mesh, layout("None", "tp").alias_placements)
    assert r.placements == (Replicate(), Shard(1))
    # factories, HyperParallel spelling (size, device_mesh, placements)
    o = ones((4, 8), mesh, (Shard(0), Shard(1)))
    assert o.to_local().shape == (2, 2) and float(o.full_tensor().sum()) == 32.0
    z = zeros((4, 8), mesh, ("dp", "None"))
    assert z.placements == (Shard(0), Replicate()) and float(z.full_tensor().abs().sum()) == 0.0
    f = full((4, 4), 2.5, device_mesh=mesh, placements=[Shard(1)])      # short placements: Replicate padded
    assert f.placements == (Shard(1), Replicate()) and float(f.full_tensor().sum()) == 40.0
    e = empty((4, 4), mesh, [Replicate(), Shard(0), Replicate()])        # extra trailing Replicate accepted
    assert e.placements == (Replicate(), Shard(0)) and e.to_local().shape == (1, 4)
    with pytest.warns(UserWarning, match=r"entries past the mesh's last dim are ignored: \(Shard\(dim=1\),\)"):
        e = empty((4, 4), mesh, [Shard(0), Replicate(), Shard(1)])   # HyperParallel: extra entries ignored
    assert e.placements == (Shard(0), Replicate())
    assert _build_layout(mesh, ("dp", "None"), 2) == x_layout.with_placements([Shard(0), Replicate()], 2)
    # DFunction with the HyperParallel-style rule
    assert get_distributed_op("HPCompatScaleByTwo") is not None
    dd = distribute_tensor(g, mesh, ("dp", "None")).requires_grad_()
    out = ScaleByTwo.apply(dd)
    assert isinstance(out, DTensor) and out.placements == (Shard(0), Replicate())
    torch.testing.assert_close(out.full_tensor(), 2 * g)
    out.full_tensor().sum().backward()
    torch.testing.assert_close(dd.grad.full_tensor(), torch.full_like(g, 2.0))
    register_distributed_op("HPCompatScaleByTwoAlias", get_distributed_op("HPCompatScaleByTwo"))
    assert get_distributed_op("HPCompatScaleByTwoAlias") is get_distributed_op("HPCompatScaleByTwo")
    # shard_module on (2, 4): alias plan, Megatron-style MLP, batch on dp, output gathered over tp
    torch.manual_seed(2)
    x = torch.randn(8, 16, dtype=torch.float64)
    y = torch.randn(8, 8, dtype=torch.float64)
    plan = ShardingPlan(
        plan={"fc1.weight": ("tp", "None"), "fc1.bias": ("tp",), "fc2.weight": ("None", "tp")},
        input_plan={"input": ("dp", "None")},
        output_plan={"output": ("dp", "None"), "fc1.output": ("dp", "tp")},
    )
    model = _train_and_compare(mesh, plan, [Shard(0), Replicate()], x, y, return_local=False)
    assert model.fc1.weight.placements == (Replicate(), Shard(0)) and model.fc2.bias.placements == (
        Replicate(), Replicate())
    # HyperParallel's README example, verbatim placements and keyword call
    x_placement = (Shard(0), Shard(1))
    w_placement = (Replicate(), Shard(0))
    out_placement = (Shard(0), Replicate())
    torch.manual_seed(5)
    simple = SimpleModel()
    ref_w = simple.weight.detach().clone().requires_grad_()
    sharding_plan = ShardingPlan(input_plan={"input": x_placement}, output_plan={"output": out_placement},
                                 plan={"weight": w_placement})
    simple = shard_module(simple, device_mesh=mesh, sharding_plan=sharding_plan)
    xs = torch.randn(8, 12, dtype=torch.float64)
    local_x = xs[rank // 4 * 4:rank // 4 * 4 + 4, rank % 4 * 3:rank % 4 * 3 + 3]
    out = simple(DTensor.from_local(local_x, mesh, x_placement))
    assert out.placements == out_placement and simple.weight.placements == w_placement
    torch.testing.assert_close(out.full_tensor(), torch.relu(xs @ ref_w))
    out.full_tensor().pow(2).sum().backward()
    torch.relu(xs @ ref_w).pow(2).sum().backward()
    torch.testing.assert_close(simple.weight.grad.full_tensor(), ref_w.grad)
    # input plan by argument name (positional and keyword), output plan per output
    two = shard_module(TwoInTwoOut(), mesh, ShardingPlan(
        input_plan={"input": {"x": ("None", "None"), "scale": [Shard(1)]}},
        output_plan={"output": [("dp", "None"), None]}))
    sc = distribute_tensor(g, mesh, ("dp", "None"))
    o1, o2 = two(dt, scale=sc)
    assert o1.placements == (Shard(0), Replicate()) and o2.placements == (Shard(1), Replicate())
    torch.testing.assert_close(o1.full_tensor(), 2 * g)
    torch.testing.assert_close(o2.full_tensor(), g + 1)
    with pytest.raises(ValueError, match=r"returned 2 outputs but the plan gives 1 layouts"):
        shard_module(TwoInTwoOut(), mesh, ShardingPlan(output_plan={"output": ("dp", "None")}))(dt, scale=sc)
    # HyperParallel's loss scaling, `loss.backward(torch.tensor(1.0 / loss.layout.repeat_num()))`: the
    # backward of reduce_partial sums over the reduced ranks (8 here), so the seed gives the exact gradients
    _, _, ref_grads = _reference(x, y, 1, 0.1)
    torch.manual_seed(0)
    m = shard_module(MLP().double(), mesh, plan)
    dist_loss = ((m(distribute_tensor(x, mesh, ("dp", "None"))) - distribute_tensor(y, mesh, ("dp", "None")))
                 ** 2).mean()
    dist_loss = dist_loss.reduce_partial()
    repeat_num = dist_loss.layout.repeat_num()
    assert repeat_num == 8
    dist_loss.backward(torch.tensor(1.0 / repeat_num, dtype=torch.float64))
    for k, p in m.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref_grads[k], rtol=1e-10, atol=1e-12)
    # bad input: plan keys that match nothing, a layout that does not fit the world
    with pytest.raises(ValueError, match=r"plan key 'fc3.weight' matches no parameter of MLP; its parameters are: "
                                         r"fc1.weight, fc1.bias"):
        shard_module(MLP(), mesh, ShardingPlan(plan={"fc3.weight": ("None", "tp")}))
    with pytest.raises(ValueError, match=r"names submodule 'head', which MLP does not have"):
        shard_module(MLP(), mesh, ShardingPlan(input_plan={"head.input": ("dp", "None")}))
    with pytest.raises(ValueError, match=r"must be 'input'/'output' or end with"):
        shard_module(MLP(), mesh, ShardingPlan(input_plan={"fc1.inputs": ("dp", "None")}))
    with pytest.raises(TypeError, match="must be a ShardingPlan"):
        shard_module(MLP(), mesh, {"fc1.weight": ("tp", "None")})
    with pytest.raises(ValueError, match=r"mesh_shape \(2, 2\) has 4 devices but the world has 8 ranks"):
        Layout((2, 2), ("dp", "tp")).mesh
    with pytest.raises(ValueError, match=r"rank_list \(8, 9, 10, 11\) uses rank 11 but the world has only 8"):
        Layout((4,), ("x",), rank_list=[8, 9, 10, 11]).mesh
    # distribute_module through HyperParallel's path: everything replicated, input hook applied
    lin = distribute_module(nn.Linear(4, 3).double(), mesh,
                            input_fn=lambda mod, inputs, m: tuple(
                                distribute_tensor(t, m, ("dp", "None")) for t in inputs))
    assert lin.weight.placements == (Replicate(), Replicate())
    torch.manual_seed(4)
    inp = torch.randn(6, 4, dtype=torch.float64)
    ref_lin = nn.Linear(4, 3).double()
    ref_lin.load_state_dict({k: v.full_tensor() for k, v in lin.state_dict().items()})
    torch.testing.assert_close(lin(inp).full_tensor(), ref_lin(inp))
    # a plain function through shard_module
    fn = shard_module(lambda t: t * 2, mesh, ShardingPlan(output_plan={"output": ("None", "None")}))
    assert fn(dt).placements == (Replicate(), Replicate())

    # ---------------------------------------------------------------- (2, 2, 2): placements plan, local outputs
    mesh3 = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "sp", "tp"))
    l3 = Layout.from_device_mesh(mesh3)
    assert l3.mesh is mesh3 and mesh3.rank == rank and mesh3.mesh_shape == (2, 2, 2)
    batch = l3(("dp", "sp"), "None")
    assert batch.repeat_num() == 2 and batch.tensor_map == ((2, 1), -1)
    plan3 = ShardingPlan(
        plan={"fc1.weight": (Replicate(), Replicate(), Shard(0)), "fc1.bias": (Replicate(), Replicate(), Shard(0)),
              "fc2.weight": l3("None", "tp")},
        input_plan={"input": batch},
        output_plan={"fc2.output": [batch]},
        return_local_tensor=["fc2"],
    )
    torch.manual_seed(3)
    x3 = torch.randn(8, 16, dtype=torch.float64)
    y3 = torch.randn(8, 8, dtype=torch.float64)
    model3 = _train_and_compare(mesh3, plan3, batch.placements, x3, y3, return_local=True)
    assert model3.fc2.weight.placements == (Replicate(), Replicate(), Shard(1))
    d3 = DTensor.from_local(x3[rank // 2 * 2:rank // 2 * 2 + 2], mesh3, batch.alias_placements)
    assert d3.shape == (8, 16) and d3.layout.repeat_num() == 2
    torch.testing.assert_close(d3.full_tensor(), x3)
    return rank


def test_hyperparallel_program_8_ranks(dist_runner):
    assert sorted(dist_runner.run(8, _compat_8_ranks)) == list(range(8))
