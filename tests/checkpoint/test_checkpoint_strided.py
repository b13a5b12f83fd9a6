"""DCP checkpoints with ``_StridedShard`` placements, and across stacks (torch <-> hyper_parallel).

Four gloo ranks build the same FSDP2 x TP2 model (and FSDP2 x EP2 experts) with torch's
``parallelize_module`` + ``fully_shard`` and with hyper_parallel's, from different weights.
A DCP checkpoint torch writes loads on ours to torch's values, and ours loads on torch to ours;
the parameters carry ``(_StridedShard(0, split_factor=2), Shard(0))`` on both sides. A residual
``_StridedShard`` (transformers' fused ``gate_up_proj``: split factor 2 on a 1-D mesh) saves one box
per range and loads back into it and into ``Shard``/``Replicate`` layouts; the state-dict helpers
copy full tensors into it.
"""
from __future__ import annotations

import torch


def _models(lib, seed):
    import torch.nn as nn
    import hyper_parallel as hp
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Shard as TShard, distribute_tensor as torch_distribute
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
    model.experts = nn.Parameter(torch.randn(4, 6, 5))
    experts = model.experts.detach()
    del model.experts
    mk = torch_mesh if lib == "torch" else hp.init_device_mesh
    mesh = mk("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    emesh = mk("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    if lib == "torch":
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        holder = nn.Module()
        holder.w = nn.Parameter(torch_distribute(experts, emesh["ep"], [TShard(0)]))
        torch_fully_shard(model, mesh=mesh["dp"])
        torch_fully_shard(holder, mesh=emesh["efsdp"])
    else:
        hp.parallelize_module(model, mesh["tp"], {"0": hp.ColwiseParallel(), "2": hp.RowwiseParallel()})
        holder = nn.Module()
        holder.w = nn.Parameter(hp.distribute_tensor(experts, emesh["ep"], [hp.Shard(0)]))
        hp.fully_shard(model, mesh=mesh["dp"])
        hp.fully_shard(holder, mesh=emesh["efsdp"])
    return model, holder


def _state(model, holder):
    return {**{k: v for k, v in model.state_dict().items()}, "experts": holder.w}


def _fulls(sd):
    return {k: v.full_tensor().detach().clone() for k, v in sd.items()}


def _across_stacks(root):
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _across_stacks64(root)
    finally:
        torch.set_default_dtype(dtype)  # the worker pool is shared with later tests


def _across_stacks64(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from hyper_parallel.placement_types import _StridedShard

    theirs = _state(*_models("torch", 0))
    ours = _state(*_models("ours", 1))
    assert isinstance(ours["0.weight"].placements[0], _StridedShard)
    assert str(ours["0.weight"].placements) == str(theirs["0.weight"].placements)
    want_t, want_o = _fulls(theirs), _fulls(ours)
    assert not torch.equal(want_t["0.weight"], want_o["0.weight"])
    dcp.save(theirs, checkpoint_id=f"{root}/torch")
    dcp.save(ours, checkpoint_id=f"{root}/ours")
    dist.barrier()
    dcp.load(ours, checkpoint_id=f"{root}/torch")      # torch's checkpoint on ours
    dcp.load(theirs, checkpoint_id=f"{root}/ours")     # ours on torch
    for k in want_t:
        assert torch.equal(ours[k].full_tensor(), want_t[k]), k
        assert torch.equal(theirs[k].full_tensor(), want_o[k]), k
    return True


def test_fsdp_tp_ep_checkpoint_across_stacks(dist_runner, tmp_path):
    assert dist_runner.run(4, _across_stacks, str(tmp_path)) == [True] * 4


def _residual(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    import hyper_parallel as hp
    from hyper_parallel.checkpoint import set_model_state_dict
    from hyper_parallel.placement_types import _StridedShard

    mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    full = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
    ss = [_StridedShard(0, split_factor=2)]
    dt = hp.distribute_tensor(full, mesh, ss)
    r = dist.get_rank()
    idx = [i for g in (range(0, 8), range(8, 16)) for i in list(g)[2 * r:2 * r + 2]]  # torch's rule by hand
    assert torch.equal(dt.to_local(), full[idx])
    dcp.save({"w": dt}, checkpoint_id=f"{root}/ss")
    dist.barrier()
    md = FileSystemReader(f"{root}/ss").read_metadata()
    assert len(md.state_dict_metadata["w"].chunks) == 8  # two ranges per rank
    for placements in (ss, [hp.Shard(0)], [hp.Replicate()], [hp.Shard(1)]):
        into = hp.distribute_tensor(torch.zeros_like(full), mesh, placements)
        dcp.load({"w": into}, checkpoint_id=f"{root}/ss")
        assert torch.equal(into.full_tensor(), full), placements
    plain = hp.distribute_tensor(full, mesh, [hp.Shard(0)])
    dcp.save({"w": plain}, checkpoint_id=f"{root}/plain")
    dist.barrier()
    into = hp.distribute_tensor(torch.zeros_like(full), mesh, ss)
    dcp.load({"w": into}, checkpoint_id=f"{root}/plain")
    assert torch.equal(into.to_local(), dt.to_local())
    # the state-dict helpers: a full tensor copied into the strided parameter
    module = torch.nn.Linear(3, 16, bias=False)
    module.weight = torch.nn.Parameter(hp.distribute_tensor(torch.zeros_like(full), mesh, ss))
    set_model_state_dict(module, {"weight": full})
    assert torch.equal(module.weight.to_local(), dt.to_local())
    return True


def test_residual_strided_shard_checkpoint(dist_runner, tmp_path):
    assert dist_runner.run(4, _residual, str(tmp_path)) == [True] * 4
