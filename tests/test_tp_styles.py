"""Parallel styles and parallelize_module: parity with the unsharded module (values and grads)."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                            Replicate, RowwiseParallel, SequenceParallel, Shard, parallelize_module)


def _mesh():
    return hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


def _check_grads(ref_mod, mod):
    for (n, p), (_, r) in zip(mod.named_parameters(), ref_mod.named_parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, hp.DTensor) else p.grad
        torch.testing.assert_close(g, r.grad, rtol=1e-5, atol=1e-5, msg=n)


def _linear_styles():
    mesh = _mesh()
    torch.manual_seed(0)
    for bias in (True, False):
        for use_local in (True, False):
            ref = nn.Linear(8, 12, bias=bias)
            x = torch.randn(3, 5, 8)
            col = parallelize_module(copy.deepcopy(ref), mesh, ColwiseParallel(use_local_output=use_local))
            out = col(x)
            assert isinstance(out, hp.DTensor) != use_local
            full = out.full_tensor() if not use_local else hp.DTensor.from_local(out, mesh, [Shard(-1)]).full_tensor()
            torch.testing.assert_close(full, ref(x), rtol=1e-5, atol=1e-5)
            (full * torch.arange(12.0)).sum().backward()
            (ref(x) * torch.arange(12.0)).sum().backward()
            _check_grads(ref, col)
            # Colwise with Replicate output; Rowwise with Shard(-1) input and Shard(1) output
            ref.zero_grad()
            row_ref = nn.Linear(12, 8, bias=bias)
            col2 = parallelize_module(copy.deepcopy(ref), mesh, ColwiseParallel(output_layouts=Replicate()))
            row = parallelize_module(copy.deepcopy(row_ref), mesh,
                                     RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                     use_local_output=use_local))
            y = row(col2(x))
            yr = row_ref(ref(x))
            yfull = y.full_tensor() if isinstance(y, hp.DTensor) else hp.DTensor.from_local(
                y, mesh, [Shard(1)], shape=yr.shape).full_tensor()
            torch.testing.assert_close(yfull, yr, rtol=1e-5, atol=1e-5)
            yfull.pow(2).sum().backward()
            yr.pow(2).sum().backward()
            _check_grads(ref, col2)
            _check_grads(row_ref, row)
            ref.zero_grad()


def test_linear_styles(dist_runner):
    dist_runner.run(2, _linear_styles)
    dist_runner.run(4, _linear_styles)


def _embedding_styles():
    mesh = _mesh()
    torch.manual_seed(0)
    ref = nn.Embedding(10, 8)
    ids = torch.randint(0, 10, (3, 5))
    for style in (RowwiseParallel(), ColwiseParallel(output_layouts=Replicate()),
                  RowwiseParallel(output_layouts=Shard(1), use_local_output=False)):
        ref.zero_grad()
        emb = parallelize_module(copy.deepcopy(ref), mesh, style)
        out = emb(ids)
        full = out.full_tensor() if isinstance(out, hp.DTensor) else out
        torch.testing.assert_close(full, ref(ids))
        full.pow(2).sum().backward()
        ref(ids).pow(2).sum().backward()
        _check_grads(ref, emb)


def test_embedding_styles(dist_runner):
    dist_runner.run(2, _embedding_styles)


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.gate = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x, scale=1.0):
        h = self.norm(x)
        return x + self.down(F.silu(self.up(h)) * self.gate(h)) * scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for l in self.layers:
            x = l(x)
        return x


def _plan_sp():
    mesh = _mesh()
    torch.manual_seed(0)
    ref = Net()
    net = copy.deepcopy(ref)
    plan = {
        "layers.*.norm": SequenceParallel(),
        "layers.*": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                       input_kwarg_layouts={"scale": None}, use_local_output=True),
        "layers.*.up": ColwiseParallel(input_layouts=Shard(1)),
        "layers.*.gate": ColwiseParallel(input_layouts=Shard(1)),
        "layers.*.down": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(net, mesh, plan)
    x = torch.randn(2, 4 * dist.get_world_size(), 8)
    xl = hp.distribute_tensor(x, mesh, [Shard(1)]).to_local()
    with hp.CommDebugMode() as fwd:
        out = net(xl)
    outf = hp.DTensor.from_local(out, mesh, [Shard(1)]).full_tensor()
    torch.testing.assert_close(outf, ref(x), rtol=1e-5, atol=1e-5)
    # per layer: up/gate share one all_gather; down reduce-scatters
    assert fwd.get_comm_counts() == {"all_gather": 2, "reduce_scatter": 2}, fwd.get_comm_counts()
    with hp.CommDebugMode() as bwd:
        (outf ** 2).sum().backward()
    ref_out = ref(x)
    (ref_out ** 2).sum().backward()
    _check_grads(ref, net)
    # per layer: one reduce_scatter for up+gate's input grad, one all_gather for down's,
    # and the two replicated LayerNorm parameters' gradients are all-reduced
    assert bwd.get_comm_counts() == {"reduce_scatter": 2, "all_gather": 2, "all_reduce": 4}, bwd.get_comm_counts()


def test_sequence_parallel_plan(dist_runner):
    dist_runner.run(2, _plan_sp)


def _plan_errors():
    mesh = _mesh()
    net = Net()
    with pytest.raises(ValueError, match="layers.*.nope"):
        parallelize_module(net, mesh, {"layers.*.nope": ColwiseParallel()})
    mesh2 = hp.init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="1-D"):
        parallelize_module(Net(), mesh2, {"layers.0.up": ColwiseParallel()})
    with pytest.raises(NotImplementedError, match="LayerNorm"):
        parallelize_module(Net(), mesh, {"layers.0.norm": ColwiseParallel()})
    # PrepareModuleOutput / InputOutput
    lin = nn.Linear(4, 4)
    ref = copy.deepcopy(lin)
    parallelize_module(lin, mesh, PrepareModuleInputOutput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_input=False,
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(0),), use_local_output=False))
    x = torch.randn(4 * dist.get_world_size(), 4)
    with hp.implicit_replication():
        y = lin(x)
    assert isinstance(y, hp.DTensor) and y.placements == (Shard(0),)
    torch.testing.assert_close(y.full_tensor(), ref(x))


def test_plan_errors_and_prepare(dist_runner):
    dist_runner.run(2, _plan_errors)
