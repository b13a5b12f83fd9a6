"""Bad checkpoints and failures: clear errors on every rank, nothing lost.

* a missing key, an unexpected key or a different global shape raises on every rank
  (``dcp.load``: CheckpointException, a BaseException; ``hyper_parallel.checkpoint.load``:
  a ValueError naming the key and both shapes, raised before any collective);
* a directory without its metadata file raises on every rank, well within the
  collective timeout;
* a rank killed in the middle of a save leaves the previous step's checkpoint
  intact and loadable through ``latest`` (real processes; the killed one calls
  ``os._exit`` from inside DCP's file writer).
"""
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import hyper_parallel as hp
from hyper_parallel import Replicate, Shard
from hyper_parallel.checkpoint import load as checked_load

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bad_keys_body(root):
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    path = os.path.join(root, "ck")
    w = hp.distribute_tensor(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)])
    dcp.save({"w": w, "b": torch.ones(3)}, checkpoint_id=path)

    def fresh(shape=(6, 4)):
        return hp.distribute_tensor(torch.zeros(shape), mesh, [Shard(1)])

    # different global shape
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"w": fresh((6, 5)), "b": torch.zeros(3)}, checkpoint_id=path)
    assert "w" in str(ei.value) and "[6, 4]" in str(ei.value) and "[6, 5]" in str(ei.value), str(ei.value)
    with pytest.raises(ValueError) as ei:
        checked_load({"w": fresh((6, 5)), "b": torch.zeros(3)}, checkpoint_id=path)
    msg = str(ei.value)
    assert "'w'" in msg and "(6, 4)" in msg and "(6, 5)" in msg, msg
    # missing key (in the state dict, not in the checkpoint)
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"w": fresh(), "b": torch.zeros(3), "extra": torch.zeros(2)}, checkpoint_id=path)
    assert "extra" in str(ei.value)
    with pytest.raises(ValueError, match="missing from the checkpoint: \\['extra'\\]"):
        checked_load({"w": fresh(), "b": torch.zeros(3), "extra": torch.zeros(2)}, checkpoint_id=path)
    # unexpected key (in the checkpoint, not in the state dict): dcp.load ignores it, ours names it
    with pytest.raises(ValueError, match="in the checkpoint but not in the state dict: \\['b'\\]"):
        checked_load({"w": fresh()}, checkpoint_id=path)
    got = {"w": fresh()}
    checked_load(got, checkpoint_id=path, strict=False)       # non-strict: partial load allowed
    assert torch.equal(got["w"].full_tensor(), w.full_tensor())
    # still usable after all those errors: a good load works
    got = {"w": fresh(), "b": torch.zeros(3)}
    checked_load(got, checkpoint_id=path)
    assert torch.equal(got["w"].full_tensor(), w.full_tensor()) and torch.equal(got["b"], torch.ones(3))

    # a directory without metadata: raises on every rank, quickly
    os.makedirs(os.path.join(root, "nometa"), exist_ok=True)
    dist.barrier()
    t0 = time.perf_counter()
    with pytest.raises(CheckpointException):
        dcp.load({"w": fresh()}, checkpoint_id=os.path.join(root, "nometa"))
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checked_load({"w": fresh()}, checkpoint_id=os.path.join(root, "nometa"))
    assert time.perf_counter() - t0 < 10
    return True


def test_bad_keys_shapes_and_missing_metadata(dist_runner, tmp_path):
    assert dist_runner.run(2, _bad_keys_body, str(tmp_path)) == [True, True]


_KILLED_SAVE = r"""
import os, sys, datetime
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
import hyper_parallel as hp
from hyper_parallel.checkpoint import get_model_state_dict, StateDictOptions
from examples.llama import checkpoint as ckpt
from examples.llama.configs import get_config
from examples.llama.model import build_model
from examples.llama.parallelize import parallelize_llama
from examples.llama.reference import build_optimizer

root = sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank = dist.get_rank()
cfg = get_config("tiny")
mesh = hp.init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
model = build_model(cfg.model, cfg.seed)
parallelize_llama(model, mesh, sequence_parallel=False, src_data_rank=None)
opt = build_optimizer(model.parameters(), cfg.optim)

def step():
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()

step()
ckpt.save(root, 1, model, opt)
ref = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if rank == 0:
    torch.save(ref, os.path.join(root, "ref1.pt"))
step()
if rank == 1:   # die in the middle of writing step 2
    from torch.distributed.checkpoint import filesystem
    orig = filesystem.FileSystemWriter.write_data
    def dying_write(self, plan, planner):
        orig(self, plan, planner).wait()
        os._exit(17)
    filesystem.FileSystemWriter.write_data = dying_write
ckpt.save(root, 2, model, opt)
print("save 2 finished on rank", rank, flush=True)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_killed_save_keeps_latest(tmp_path):
    root = str(tmp_path / "ck")
    os.makedirs(root)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        procs.append(subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, ROOT, root], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    assert procs[1].returncode == 17, outs[1][-3000:]
    assert procs[0].returncode != 0 and "save 2 finished" not in outs[0], outs[0][-3000:]   # rank 0 did not finish
    from examples.llama import checkpoint as ckpt
    assert open(os.path.join(root, "latest")).read().strip() == "step-000001"
    assert not os.path.exists(os.path.join(root, "step-000002", ".metadata"))
    # the previous checkpoint loads (here in one process, into the plain model)
    from examples.llama.configs import get_config
    from examples.llama.model import build_model
    from examples.llama.reference import build_optimizer
    cfg = get_config("tiny")
    model = build_model(cfg.model, cfg.seed)
    opt = build_optimizer(model.parameters(), cfg.optim)
    assert ckpt.resume(root, model, opt) == 1
    ref = torch.load(os.path.join(root, "ref1.pt"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


# ---------------------------------------------------------------- bad input to the helpers (one process, no groups)
def _plain_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def test_helpers_plain_module_and_bad_input():
    from hyper_parallel.checkpoint import (StateDictOptions, get_state_dict, set_model_state_dict,
                                           set_optimizer_state_dict, set_state_dict)
    model = _plain_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    assert sorted(msd) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert sorted(osd["state"]) == sorted(msd) and osd["param_groups"][0]["params"] == list(msd)
    # round trip into a fresh model/optimizer (whose lazy state is created on demand)
    fresh = _plain_model()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    full = {k: v.clone() for k, v in msd.items()}
    set_state_dict(fresh, fopt, model_state_dict=full, optim_state_dict=osd)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    assert fopt.param_groups[0]["lr"] == 0.1
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(fopt.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"])
    # torch.compile's wrapper prefix is not part of the canonical keys
    wrapped = torch.nn.Module()
    wrapped._orig_mod = _plain_model()
    assert sorted(get_state_dict(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1))[0]) == sorted(msd)
    # errors name what is wrong
    with pytest.raises(RuntimeError, match=r"missing keys \['2.bias'\], unexpected keys \['x'\]"):
        set_model_state_dict(fresh, {**{k: v for k, v in full.items() if k != "2.bias"}, "x": torch.ones(1)})
    keys = set_model_state_dict(fresh, {k: v for k, v in full.items() if k != "2.bias"},
                                options=StateDictOptions(strict=False))
    assert keys.missing_keys == ["2.bias"] and keys.unexpected_keys == []
    with pytest.raises(ValueError, match=r"'0.weight'.*shape \(4, 4\).*global shape \(3, 4\)"):
        set_model_state_dict(fresh, {**full, "0.weight": torch.ones(4, 4)})
    with pytest.raises(TypeError, match="StateDictOptions.strict must be a bool"):
        StateDictOptions(strict="yes")
    with pytest.raises(TypeError, match="options must be a hyper_parallel.checkpoint.StateDictOptions"):
        get_state_dict(model, opt, options={"full_state_dict": True})
    with pytest.raises(TypeError, match="optimizers"):
        get_state_dict(model, 3)
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        get_state_dict(model, other)
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        set_optimizer_state_dict(model, opt, {"state": {}})
