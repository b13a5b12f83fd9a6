"""Optimizers on DTensor parameters: training equals single-process training."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Replicate, Shard


USE_NORM = True


class MLP(nn.Module):
    def __init__(self, d=8, h=16):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)
        self.norm = nn.LayerNorm(d) if USE_NORM else nn.Identity()

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(self.norm(x))))


def _shard_mlp(model, mesh, tp_dim):
    def partition(name, mod, m):
        if name == "fc1":
            mod.weight = nn.Parameter(hp.distribute_tensor(mod.weight.data, m, _pl(m, tp_dim, 0)))
            mod.bias = nn.Parameter(hp.distribute_tensor(mod.bias.data, m, _pl(m, tp_dim, 0)))
        elif name == "fc2":
            mod.weight = nn.Parameter(hp.distribute_tensor(mod.weight.data, m, _pl(m, tp_dim, 1)))
    return hp.distribute_module(model, mesh, partition)


def _pl(mesh, tp_dim, shard_dim):
    return [Shard(shard_dim) if d == tp_dim else Replicate() for d in range(mesh.ndim)]


def _train(opt_name, foreach, mesh_shape):
    torch.manual_seed(0)
    mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[-len(mesh_shape):])
    ref = MLP()
    model = _shard_mlp(copy.deepcopy(ref), mesh, mesh.ndim - 1)
    kw = dict(lr=1e-2)
    if opt_name == "sgd":
        make = lambda p: torch.optim.SGD(p, momentum=0.9, foreach=foreach, **kw)
    elif opt_name == "adam":
        make = lambda p: torch.optim.Adam(p, foreach=foreach, **kw)
    else:
        make = lambda p: torch.optim.AdamW(p, weight_decay=0.1, foreach=foreach, **kw)
    opt_ref, opt = make(ref.parameters()), make(model.parameters())
    batch_pl = [Shard(0)] + [Replicate()] * (mesh.ndim - 1) if mesh.ndim == 2 else [Replicate()]
    for step in range(10):
        x = torch.randn(12, 8)
        y = torch.randn(12, 8)
        loss_ref = F.mse_loss(ref(x), y)
        opt_ref.zero_grad()
        loss_ref.backward()
        norm_ref = nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt_ref.step()

        dx = hp.distribute_tensor(x, mesh, batch_pl)
        dy = hp.distribute_tensor(y, mesh, batch_pl)
        out = model(dx)
        loss = ((out - dy) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        torch.testing.assert_close(loss.full_tensor(), loss_ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm.full_tensor(), norm_ref, rtol=1e-5, atol=1e-6)
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert isinstance(p, hp.DTensor), n
        torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-5, atol=1e-5, msg=n)
    # state dicts keep DTensors and load back
    sd = model.state_dict()
    assert all(isinstance(v, hp.DTensor) for v in sd.values())
    osd = opt.state_dict()
    st = next(iter(osd["state"].values()))
    assert any(isinstance(v, hp.DTensor) for v in st.values())
    model2 = _shard_mlp(MLP(), mesh, mesh.ndim - 1)
    model2.load_state_dict(sd)
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), msg=n)
    opt2 = make(model2.parameters())
    opt2.load_state_dict(osd)


@pytest.mark.parametrize("opt_name,foreach", [("sgd", False), ("adam", True), ("adamw", False), ("adamw", True)])
def test_optimizers_tp(dist_runner, opt_name, foreach):
    dist_runner.run(2, _train, opt_name, foreach, (2,))


def test_adamw_dp_tp(dist_runner):
    dist_runner.run(4, _train, "adamw", True, (2, 2))


class Attn(nn.Module):
    """A small attention block computed entirely on DTensors (heads sharded by the parameters)."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.wqkv = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(3)])
        self.wo = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm(x)
        q, k, v = [w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in self.wqkv]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(b, s, d)
        return x + F.dropout(self.wo(o), p=0.0)


def _train_attention():
    torch.manual_seed(0)
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    ref = Attn()
    model = copy.deepcopy(ref)

    def partition(name, mod, m):
        if name.startswith("wqkv."):
            mod.weight = nn.Parameter(hp.distribute_tensor(mod.weight.data, m, [Shard(0)]))
        elif name == "wo":
            mod.weight = nn.Parameter(hp.distribute_tensor(mod.weight.data, m, [Shard(1)]))
    hp.distribute_module(model, mesh, partition)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(10):
        x = torch.randn(2, 6, 16)
        loss_ref = ref(x).pow(2).mean()
        opt_ref.zero_grad()
        loss_ref.backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt_ref.step()
        out = model(hp.distribute_tensor(x, mesh, [Replicate()]))
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        torch.testing.assert_close(loss.full_tensor(), loss_ref.detach(), rtol=1e-5, atol=1e-6)
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-5, atol=1e-5, msg=n)


def test_attention_block_training(dist_runner):
    dist_runner.run(2, _train_attention)
