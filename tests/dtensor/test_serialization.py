"""``torch.save`` / ``torch.load`` (and pickle, ``copy``) of DTensors, per rank.

As with ``torch.distributed.tensor``: each rank saves its own shard with the
mesh and layout; loading in a job whose world holds the mesh gives back a
DTensor with the same mesh, layout, global shape and local values, also under
``torch.load(weights_only=True)`` (the default). The round trips here cover
module and optimizer state dicts and check that training resumes exactly.
"""
import copy
import io
import pickle

import torch
import torch.distributed as dist
import torch.nn as nn

import hyper_parallel as hp
from hyper_parallel import ColwiseParallel, Partial, Replicate, RowwiseParallel, Shard, parallelize_module
from tests.harness.parity import seeded_mlp


def _roundtrip(obj, weights_only=True):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only)


def _same(a, b):
    assert type(a) is type(b) is hp.DTensor, (type(a), type(b))
    assert a.device_mesh == b.device_mesh, (a.device_mesh, b.device_mesh)
    assert a.layout == b.layout, (a.layout, b.layout)
    assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
    torch.testing.assert_close(a.to_local(), b.to_local(), rtol=0, atol=0)


def _tensors_body():
    ws = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(7, 6, generator=g)  # uneven over 2 and 4
    cases = {
        "s0r": hp.distribute_tensor(full, mesh, [Shard(0), Replicate()]),
        "s1s0": hp.distribute_tensor(full, mesh, [Shard(1), Shard(0)]),
        "alias": hp.distribute_tensor(full, mesh, (("dp", "tp"), "None")),
        "partial": hp.DTensor.from_local(torch.ones(3, 2), mesh, [Partial(), Replicate()]),
        "sub": hp.distribute_tensor(full.double(), mesh["tp"], [Shard(1)]),
        "int": hp.distribute_tensor(torch.arange(12).reshape(3, 4), mesh, [Replicate(), Shard(1)]),
    }
    for weights_only in (True, False):
        back = _roundtrip(cases, weights_only)
        for k in cases:
            _same(cases[k], back[k])
        # the loaded DTensors compute: same full tensor, same result of an op with communication
        torch.testing.assert_close(back["s1s0"].full_tensor(), full, rtol=0, atol=0)
        torch.testing.assert_close(back["alias"].sum().full_tensor(), cases["alias"].sum().full_tensor())
    for k, v in cases.items():
        _same(v, pickle.loads(pickle.dumps(v)))
        c = copy.copy(v)
        _same(v, c)
        d = copy.deepcopy(v)
        _same(v, d)
        assert d.to_local().data_ptr() != v.to_local().data_ptr()
    # requires_grad survives; the loaded leaf trains
    p = hp.distribute_tensor(full, mesh, [Shard(0), Replicate()]).requires_grad_()
    q = _roundtrip(p)
    assert q.requires_grad and q.is_leaf
    (q * 2).sum().backward()
    torch.testing.assert_close(q.grad.full_tensor(), torch.full_like(full, 2.0))
    return True


def test_save_load_dtensors_2(dist_runner):
    assert dist_runner.run(2, _tensors_body) == [True] * 2


def test_save_load_dtensors_4(dist_runner):
    assert dist_runner.run(4, _tensors_body) == [True] * 4


def _checkpoint_body():
    ws = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def step(model, opt):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    a = parallelize_module(seeded_mlp(), mesh, plan)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    step(a, opt_a)
    # per-rank checkpoint of model and optimizer
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": opt_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)  # weights_only=True, the default
    assert all(isinstance(v, hp.DTensor) for v in ckpt["model"].values())
    assert all(isinstance(s["exp_avg"], hp.DTensor) for s in ckpt["optim"]["state"].values())

    # a fresh parallel model resumes from it and follows the original exactly
    b = parallelize_module(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), mesh, plan)
    b.load_state_dict(ckpt["model"])
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    opt_b.load_state_dict(ckpt["optim"])
    for _ in range(3):
        la, lb = step(a, opt_a), step(b, opt_b)
        assert la == lb, (la, lb)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        _same(pa.detach(), pb.detach())
    return True


def test_checkpoint_resume_2(dist_runner):
    assert dist_runner.run(2, _checkpoint_body) == [True] * 2


def _missing_groups_body():
    import pytest
    from hyper_parallel.platform import get_platform
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(16.).reshape(4, 4)
    buf = io.BytesIO()
    torch.save(hp.distribute_tensor(full, mesh, [Shard(0), Shard(1)]), buf)
    # a process that never made the (2, 2) mesh: every rank raises the same clear error, nobody
    # enters a collective that the others skip
    get_platform().reset_groups()
    buf.seek(0)
    with pytest.raises(RuntimeError, match=r"no process group over ranks \[0, 2\].*"
                                           r"init_device_mesh\('cpu', \(2, 2\), mesh_dim_names=\('dp', 'tp'\)\)"):
        torch.load(buf)
    hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # as the message says
    buf.seek(0)
    back = torch.load(buf)
    torch.testing.assert_close(back.full_tensor(), full, rtol=0, atol=0)
    return True


def test_load_without_mesh_groups_raises_4(dist_runner):
    assert dist_runner.run(4, _missing_groups_body) == [True] * 4
