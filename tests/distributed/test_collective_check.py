"""The opt-in desynchronisation check (``HYPER_PARALLEL_CHECK_COLLECTIVES=1`` /
``hyper_parallel.debug.check_collectives()``), on 2 ranks of the shared pool.

* off by default;
* healthy programs (TP training, FSDP training, redistributions over every placement pair, a
  cross-mesh exchange) give bit-identical values and the same collective counts with the check on;
* ranks about to issue different collectives raise ``CollectiveMismatchError`` on every rank with
  both ranks' descriptions instead of hanging or reducing the wrong tensors: a rank-dependent
  shape (an uneven last batch), a data-dependent branch (all_gather on one rank, all_reduce on the
  other, with the placements named), the same collective from two different lines, and a
  cross-mesh exchange whose sides disagree on the message size; the ranks stay usable after.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from hyper_parallel.debug import CollectiveMismatchError, check_collectives


def _tp_train(steps=3):
    torch.manual_seed(0)
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double()
    hp.parallelize_module(model, mesh, {"0": hp.ColwiseParallel(), "2": hp.RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with hp.CommDebugMode() as comm:
        for step in range(steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
            loss = model(x).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, [p.full_tensor() for p in model.parameters()], dict(comm.get_comm_counts())


def _fsdp_train(steps=2):
    torch.manual_seed(0)
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double()
    hp.fully_shard(model[0], mesh=mesh)
    hp.fully_shard(model[2], mesh=mesh)
    hp.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with hp.CommDebugMode() as comm:
        for step in range(steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + step), dtype=torch.float64)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return [p.full_tensor() for p in model.parameters()], dict(comm.get_comm_counts())


def _redistributions():
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    full = torch.arange(30, dtype=torch.float64).reshape(5, 6)
    out = []
    for src in ([Shard(0)], [Shard(1)], [Replicate()], [Partial()]):
        for dst in ([Shard(0)], [Shard(1)], [Replicate()]):
            x = hp.distribute_tensor(full, mesh, src)
            out.append(x.redistribute(mesh, dst).full_tensor())
    a, b = hp.DeviceMesh("cpu", [0]), hp.DeviceMesh("cpu", [1])
    y = hp.distribute_tensor(full, a, [Replicate()]).redistribute(b, [Shard(0)])
    out.append(y.to_local().clone())
    return out


def _healthy_body():
    assert not hp.debug.check_collectives_enabled()  # off by default
    ref = (_tp_train(), _fsdp_train(), _redistributions())
    with check_collectives():
        assert hp.debug.check_collectives_enabled()
        got = (_tp_train(), _fsdp_train(), _redistributions())
    assert not hp.debug.check_collectives_enabled()
    (l0, p0, c0), (f0, fc0), r0 = ref
    (l1, p1, c1), (f1, fc1), r1 = got
    assert l0 == l1 and c0 == c1 and fc0 == fc1, (l0, l1, c0, c1, fc0, fc1)
    for a, b in zip(p0 + f0 + r0, p1 + f1 + r1):
        assert torch.equal(a, b)
    return c0, fc0


def test_check_is_transparent_on_healthy_programs(dist_runner):
    out = dist_runner.run(2, _healthy_body)
    (tp_counts, fsdp_counts), _ = out
    assert tp_counts == {"all_reduce": 3} and fsdp_counts.get("reduce_scatter", 0) == 4, out


def _expect_mismatch(fn):
    with check_collectives():
        with pytest.raises(CollectiveMismatchError) as ei:
            fn()
    return str(ei.value), ei.value.descriptions


def _after_is_usable(mesh):
    t = hp.DTensor.from_local(torch.ones(2), mesh, [Partial()]).full_tensor()
    assert torch.equal(t, torch.full((2,), 2.0))


def _mismatch_body():
    import torch.distributed as dist
    rank = dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    res = {}
    # 1. a rank-dependent shape (an uneven last batch): an all_reduce of [2] against one of [3]
    p = hp.DTensor.from_local(torch.ones(2 + rank), mesh, [Partial()], shape=(2 + rank,), stride=(1,))
    res["shape"] = _expect_mismatch(p.full_tensor)
    _after_is_usable(mesh)
    # 2. a data-dependent branch: rank 0 gathers a Shard(0) tensor, rank 1 reduces a Partial one
    x = hp.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    y = hp.DTensor.from_local(torch.ones(4, 2), mesh, [Partial()])
    res["branch"] = _expect_mismatch(lambda: x.redistribute(mesh, [Replicate()]) if rank == 0
                                     else y.redistribute(mesh, [Replicate()]))
    _after_is_usable(mesh)
    # 3. the same collective reached from two different lines
    if rank == 0:
        res["site"] = _expect_mismatch(lambda: y.full_tensor())
    else:
        res["site"] = _expect_mismatch(lambda: y.full_tensor())
    _after_is_usable(mesh)
    # 4. a cross-mesh exchange whose sides disagree on the size (16 elements sent, 8 expected)
    a, b = hp.DeviceMesh("cpu", [0]), hp.DeviceMesh("cpu", [1])
    z = hp.DTensor.from_local(torch.ones(4, 4) if rank == 0 else torch.empty(0, 0), a, [Replicate()],
                              shape=(4, 4) if rank == 0 else (4, 2), stride=(4, 1) if rank == 0 else (2, 1))
    res["p2p"] = _expect_mismatch(lambda: z.redistribute(b, [Replicate()]))
    _after_is_usable(mesh)
    assert not hp.debug.check_collectives_enabled()
    return res


def test_desynchronized_collectives_raise_on_every_rank(dist_runner):
    out = dist_runner.run(2, _mismatch_body)
    for rank, res in enumerate(out):
        msg, descs = res["shape"]
        assert sorted(descs) == [0, 1], descs
        assert "desynchronized" in msg and f"rank {rank} was about to issue all_reduce" in msg, msg
        for r in (0, 1):
            line = next(ln for ln in msg.splitlines() if ln.strip().startswith(f"rank {r}: "))
            assert line.strip().startswith(f"rank {r}: all_reduce on ranks (0, 1) [mesh dim 0 'tp' of mesh (2,)"), line
            assert f"tensor [{2 + r}] float32, op sum, placements (Partial(sum),) -> (Replicate(),)" in line, line
        assert "test_collective_check.py" in msg, msg  # the call site
        msg, descs = res["branch"]
        assert descs[0].startswith("all_gather on ranks (0, 1)") and descs[1].startswith("all_reduce on ranks (0, 1)")
        assert "placements (Shard(dim=0),) -> (Replicate(),)" in descs[0], descs[0]
        assert "placements (Partial(sum),) -> (Replicate(),)" in descs[1], descs[1]
        assert descs[0] in msg and descs[1] in msg
        msg, descs = res["site"]
        line0, line1 = (d.rsplit(":", 1)[1] for d in (descs[0], descs[1]))
        assert line0 != line1 and descs[0].split(", called from")[0] == descs[1].split(", called from")[0], descs
        msg, descs = res["p2p"]
        assert "16 x float32 from rank 0 to rank 1" in descs[0] and "8 x float32 from rank 0 to rank 1" in descs[1], \
            descs
        assert "cross-mesh p2p" in msg
