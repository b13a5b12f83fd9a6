"""``torch.distributed.checkpoint`` (save / load / async_save) on hyper_parallel DTensors.

One 4-rank task saves a state dict of DTensors in many layouts (1-D, 2-D and 3-D
meshes, uneven shards, alias spelling, one tensor dim over two mesh dims, sub-mesh,
int and 0-d tensors, plain tensors and Python values alongside) and loads it back
into *other* layouts; every value is checked against the full tensor. The saved
metadata shows a replicated tensor written once. Partial tensors are refused with a
clear error on every rank; ``async_save`` saves the values at the call even when
they change right after it. An 8-rank task does the same on a (2, 2, 2) mesh.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard


def _fulls():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(7, 5, generator=g),            # uneven over 2 and 4
        "b": torch.randn(9, generator=g),
        "c": torch.randn(6, 10, 3, generator=g),
        "i": torch.arange(30, dtype=torch.int64).reshape(5, 6),
        "s": torch.tensor(3.5),
        "rep": torch.randn(4, 4, generator=g),
    }


def _meshes():
    m1 = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    m2 = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m3 = hp.init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("p", "q", "r"))
    return m1, m2, m3


def _layouts_save(m1, m2, m3):
    return {
        "a": (m2, (("dp", "tp"), "None")),                 # alias: dim 0 over both mesh dims
        "b": (m1, [Shard(0)]),
        "c": (m3, [Shard(1), Replicate(), Shard(0)]),
        "i": (m2, [Replicate(), Shard(1)]),
        "s": (m2, [Replicate(), Replicate()]),
        "rep": (m2, [Replicate(), Replicate()]),
    }


def _layouts_load(m1, m2, m3):
    return {
        "a": (m3, [Shard(1), Replicate(), Shard(1)]),
        "b": (m2, [Shard(0), Shard(0)]),
        "c": (m2, ("None", ("tp", "dp"), "None")),         # dim 1 over tp then dp
        "i": (m1, [Shard(0)]),
        "s": (m1, [Replicate()]),
        "rep": (m2["tp"], [Shard(0)]),                     # sub-mesh
    }


def _build(fulls, layouts, zero=False):
    return {k: hp.distribute_tensor(torch.zeros_like(fulls[k]) if zero else fulls[k].clone(), m, pl)
            for k, (m, pl) in layouts.items()}


def _check_all(sd, fulls):
    for k, full in fulls.items():
        got = sd[k].full_tensor() if isinstance(sd[k], hp.DTensor) else sd[k]
        assert got.dtype == full.dtype, (k, got.dtype)
        assert torch.equal(got, full), k


def _layouts_body(root):
    rank = dist.get_rank()
    fulls = _fulls()
    m1, m2, m3 = _meshes()
    path = os.path.join(root, "layouts")
    sd = _build(fulls, _layouts_save(m1, m2, m3))
    sd["plain"] = fulls["a"] * 2            # a plain tensor: every rank has it, written once
    sd["meta"] = {"step": 7, "name": "x"}   # nested Python values
    dcp.save(sd, checkpoint_id=path)

    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert len(md["rep"].chunks) == 1 and len(md["s"].chunks) == 1   # replicated: one box, written once
    assert len(md["i"].chunks) == 2                                  # 2 tp boxes, not 4
    assert len(md["a"].chunks) == 4 and len(md["c"].chunks) == 4
    assert tuple(md["a"].size) == (7, 5)
    assert md["a"].properties.dtype == torch.float32 and md["i"].properties.dtype == torch.int64
    dist.barrier()

    # load into other layouts (resharding), a sub-mesh, and plain tensors
    back = _build(fulls, _layouts_load(m1, m2, m3), zero=True)
    back["plain"] = hp.distribute_tensor(torch.zeros(7, 5), m2, [Shard(1), Replicate()])
    back["meta"] = {"step": 0, "name": ""}
    dcp.load(back, checkpoint_id=path)
    _check_all(back, fulls)
    assert torch.equal(back["plain"].full_tensor(), fulls["a"] * 2)
    assert back["meta"] == {"step": 7, "name": "x"}
    plain = {k: torch.zeros_like(v) for k, v in fulls.items()}
    dcp.load(plain, checkpoint_id=path)
    _check_all(plain, fulls)
    # ... and a checkpoint of plain tensors loads into DTensors
    path2 = os.path.join(root, "plain")
    dcp.save({k: v.clone() for k, v in fulls.items()}, checkpoint_id=path2)
    back2 = _build(fulls, _layouts_save(m1, m2, m3), zero=True)
    dcp.load(back2, checkpoint_id=path2)
    _check_all(back2, fulls)

    # a Partial DTensor is refused on every rank, naming the key and the remedy
    bad = {"p": hp.DTensor.from_local(torch.ones(3), m1, [Partial()])}
    with pytest.raises(CheckpointException) as ei:
        dcp.save(bad, checkpoint_id=os.path.join(root, "partial"))
    assert "'p'" in str(ei.value) and "reduce_partial" in str(ei.value), str(ei.value)
    ok = {"p": bad["p"].reduce_partial()}
    dcp.save(ok, checkpoint_id=os.path.join(root, "partial"))
    got = {"p": hp.distribute_tensor(torch.zeros(3), m2, [Shard(0), Replicate()])}
    dcp.load(got, checkpoint_id=os.path.join(root, "partial"))
    assert torch.equal(got["p"].full_tensor(), torch.full((3,), 4.0))

    # the state-dict helpers reduce a Partial value before handing it to DCP
    from hyper_parallel.checkpoint import get_model_state_dict
    mod = torch.nn.Module()
    mod.register_buffer("acc", hp.DTensor.from_local(torch.full((3,), float(rank)), m1, [Partial()]))
    msd = get_model_state_dict(mod)
    assert not msd["acc"].layout.has_partial() and torch.equal(msd["acc"].full_tensor(), torch.full((3,), 6.0))
    dcp.save(msd, checkpoint_id=os.path.join(root, "partial_helper"))

    # async_save: the values at the call are saved even though they change right after it
    w = hp.distribute_tensor(fulls["a"].clone(), m2, [Shard(0), Shard(1)])
    state = {"w": w, "step": torch.tensor(1)}
    fut = dcp.async_save(state, checkpoint_id=os.path.join(root, "async"))
    with torch.no_grad():
        for _ in range(3):                       # "the optimizer keeps stepping"
            w.mul_(2.0).add_(1.0)
        state["step"].add_(5)
    fut.result()
    got = {"w": hp.distribute_tensor(torch.zeros(7, 5), m1, [Shard(1)]), "step": torch.tensor(0)}
    dcp.load(got, checkpoint_id=os.path.join(root, "async"))
    assert torch.equal(got["w"].full_tensor(), fulls["a"]) and got["step"].item() == 1
    assert torch.equal(w.full_tensor(), ((fulls["a"] * 2 + 1) * 2 + 1) * 2 + 1)
    return rank


def test_dcp_layouts_resharding_partial_async(dist_runner, tmp_path):
    assert dist_runner.run(4, _layouts_body, str(tmp_path)) == [0, 1, 2, 3]
    # every element was written exactly once: the stored boxes of each tensor add up to its size
    md = dcp.FileSystemReader(str(tmp_path / "layouts")).read_metadata()
    stored = {}
    for idx, info in md.storage_data.items():
        stored[idx.fqn] = stored.get(idx.fqn, 0) + 1
    for k, v in _fulls().items():
        chunks = md.state_dict_metadata[k].chunks
        assert stored[k] == len(chunks), (k, stored[k], len(chunks))
        assert sum(torch.Size(c.sizes).numel() for c in chunks) == v.numel(), k


def _mesh_3d_body(root):
    """A (2, 2, 2) mesh: shards over all three mesh dims, one dim over two of them, uneven; reshard on load."""
    m = hp.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    g = torch.Generator().manual_seed(1)
    full = {"x": torch.randn(9, 6, 5, generator=g), "y": torch.randn(11, 3, generator=g)}
    sd = {"x": hp.distribute_tensor(full["x"], m, [Shard(0), Shard(2), Shard(1)]),
          "y": hp.distribute_tensor(full["y"], m, (("a", "c"), "None"))}
    dcp.save(sd, checkpoint_id=os.path.join(root, "m3"))
    back = {"x": hp.distribute_tensor(torch.zeros(9, 6, 5), m, ("None", ("c", "b"), "a")),
            "y": hp.distribute_tensor(torch.zeros(11, 3), m, [Replicate(), Shard(0), Replicate()])}
    dcp.load(back, checkpoint_id=os.path.join(root, "m3"))
    md = dcp.FileSystemReader(os.path.join(root, "m3")).read_metadata().state_dict_metadata
    return (all(torch.equal(back[k].full_tensor(), full[k]) for k in full),
            len(md["x"].chunks), len(md["y"].chunks))


def test_dcp_3d_mesh(dist_runner, tmp_path):
    # x: 8 distinct boxes; y: 4 (replicated over "b": written once)
    assert dist_runner.run(8, _mesh_3d_body, str(tmp_path)) == [(True, 8, 4)] * 8
