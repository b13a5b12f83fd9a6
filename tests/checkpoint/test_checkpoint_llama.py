"""Resharding checkpoints of the example Llama: save in one parallel layout, resume in another.

Layouts: one process (plain model), TP 2, TP 4, ``replicate`` dp 2 x TP 2, and the
``fully_shard`` ones FSDP 4, FSDP 2 x TP 2, HSDP 2 x 2 (small config, fp32, AdamW with
clipping). Each source layout trains 2 steps, saves with ``examples/llama/checkpoint.py``
(DCP + ``hyper_parallel.checkpoint``), records its full state dict and then trains 3
more steps (the uninterrupted run). Each target layout resumes from another layout's
checkpoint, at a different world size (sampled: every FSDP layout once as source, once
as target):

    single -> tp4, fsdp4         tp2 -> dp2tp2, fsdp2tp2, hsdp     tp4 -> single
    dp2tp2 -> tp2, dp2tp2        fsdp4 -> tp2    fsdp2tp2 -> single    hsdp -> tp2

Parameters and optimizer states must come back bit-exact (full tensors compared
with ``torch.equal``) and 3 further steps must equal the uninterrupted run (bit-exact
in the same layout; to fp32 rounding across layouts, whose reductions differ).
Each source also ``async_save``s the same step and keeps training while it is written;
the targets load that checkpoint too and must get the values at the call.
Also: full and rank-0-broadcast state dicts loaded into TP 2, FSDP 2 x TP 2 and HSDP
2 x 2 models, state dicts taken in the middle of an FSDP step (root group unsharded),
and the offline ``dcp_to_torch_save`` file loaded in a process without torch.distributed.
"""
import os
import subprocess
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import hyper_parallel as hp
from hyper_parallel.checkpoint import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                       get_state_dict, load as checked_load, set_state_dict)
from examples.llama import checkpoint as ckpt
from examples.llama.configs import get_config
from examples.llama.data import TokenBatches, dp_shard
from examples.llama.model import build_model, loss_fn
from examples.llama.parallelize import parallelize_llama, train_loss
from examples.llama.reference import build_optimizer
from tests.harness.launch import run_launch

# (dp replicate, dp_shard (fully_shard), tp)
LAYOUTS = {"single": (1, 1, 1), "tp2": (1, 1, 2), "tp4": (1, 1, 4), "dp2tp2": (2, 1, 2),
           "fsdp4": (1, 4, 1), "fsdp2tp2": (1, 2, 2), "hsdp": (2, 2, 1)}
SAVE_AT, MORE = 2, 3
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg():
    cfg = get_config("tiny")
    return replace(cfg, model=replace(cfg.model, n_kv_heads=4))   # 4 kv heads: TP 4 possible


def _build(layout):
    cfg = _cfg()
    dp, dps, tp = LAYOUTS[layout]
    model = build_model(cfg.model, cfg.seed)
    mesh = None
    if dps > 1:
        mesh = hp.init_device_mesh("cpu", (dp, dps, tp), mesh_dim_names=("dp", "dp_shard", "tp"))
        parallelize_llama(model, mesh, sequence_parallel=False, src_data_rank=None)
    elif dp * tp > 1:
        mesh = hp.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_llama(model, mesh, sequence_parallel=False, src_data_rank=None)
    return model, build_optimizer(model.parameters(), cfg.optim), mesh


def _train(model, opt, mesh, start, n):
    cfg = _cfg()
    data = TokenBatches(seed=cfg.seed)
    dp, dp_rank = 1, 0
    if mesh is not None:
        names = mesh.mesh_dim_names
        for name in ("dp", "dp_shard"):   # batch rank over (dp, dp_shard), dp outermost
            if name in names:
                dp_rank, dp = dp_rank * mesh.size(name) + mesh.get_local_rank(name), dp * mesh.size(name)
    losses = []
    for step in range(start, start + n):
        x, y = data.get_batch(step, cfg.global_batch, cfg.seq_len)
        if dp > 1:
            x, y = dp_shard(x, dp_rank, dp), dp_shard(y, dp_rank, dp)
        opt.zero_grad(set_to_none=True)
        g = train_loss(model, x, y, loss_fn).clone()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
        opt.step()
        if dp > 1:   # every tp rank holds the same loss: average over the whole world
            dist.all_reduce(g)
            g /= dist.get_world_size()
        losses.append(g.item())
    return losses


def _full(model, opt):
    msd, osd = get_state_dict(model, opt, options=FULL)
    return {"model": msd, "optim": osd}


def _assert_state_equal(got, want, exact=True):
    assert sorted(got["model"]) == sorted(want["model"])
    for k, v in want["model"].items():
        if exact:
            assert torch.equal(got["model"][k], v), k
        else:
            torch.testing.assert_close(got["model"][k], v, rtol=1e-4, atol=1e-5, msg=k)
    assert sorted(got["optim"]["state"]) == sorted(want["optim"]["state"])
    for fqn, st in want["optim"]["state"].items():
        for k, v in st.items():
            if exact:
                assert torch.equal(got["optim"]["state"][fqn][k], v), (fqn, k)
            else:
                torch.testing.assert_close(got["optim"]["state"][fqn][k], v, rtol=1e-4, atol=1e-5)
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]


def _save_body(root, layouts):
    for layout in layouts:
        model, opt, mesh = _build(layout)
        _train(model, opt, mesh, 0, SAVE_AT)
        ckpt.save(os.path.join(root, layout), SAVE_AT, model, opt)
        at_save = _full(model, opt)
        # async_save of the same state, then the optimizer keeps stepping while it is written
        msd, osd = get_state_dict(model, opt)
        # (its collectives run in a background thread: a group of their own keeps them apart from training's)
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"{layout}-async"),
                             process_group=dist.new_group(backend="gloo"))
        losses = _train(model, opt, mesh, SAVE_AT, MORE)
        fut.result()
        after = _full(model, opt)
        if dist.get_rank() == 0:
            torch.save({"at_save": at_save, "losses": losses, "after": after},
                       os.path.join(root, f"{layout}_ref.pt"))
        dist.barrier()
    return True


def _load_body(root, pairs):
    for src, dst in pairs:
        ref = torch.load(os.path.join(root, f"{src}_ref.pt"))
        model, opt, mesh = _build(dst)
        assert ckpt.resume(os.path.join(root, src), model, opt) == SAVE_AT
        got = _full(model, opt)
        if dist.get_rank() == 0:
            _assert_state_equal(got, ref["at_save"], exact=True)
        # the async_save made at the same step holds the values at its call, not later ones
        amodel, aopt, _ = _build(dst)
        msd, osd = get_state_dict(amodel, aopt)
        state = {"model": msd, "optim": osd}
        checked_load(state, checkpoint_id=os.path.join(root, f"{src}-async"))
        set_state_dict(amodel, aopt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = _full(amodel, aopt)
        if dist.get_rank() == 0:
            _assert_state_equal(got, ref["at_save"], exact=True)
        losses = _train(model, opt, mesh, SAVE_AT, MORE)
        after = _full(model, opt)
        if dist.get_rank() == 0:
            same = LAYOUTS[src] == LAYOUTS[dst]
            if same:
                assert losses == ref["losses"], (losses, ref["losses"])
            else:
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
            _assert_state_equal(after, ref["after"], exact=same)
    return True


def _full_and_broadcast_body(root, layout="tp2"):
    """A full plain state dict (one process's) into a parallel model: held by every rank, or by rank 0 only."""
    ref = torch.load(os.path.join(root, "single_ref.pt"))["at_save"]
    for broadcast in (False, True):
        model, opt, _ = _build(layout)
        held = ref if (not broadcast or dist.get_rank() == 0) else {"model": {}, "optim": {}}
        set_state_dict(model, opt, model_state_dict=held["model"], optim_state_dict=held["optim"],
                       options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast))
        got = _full(model, opt)
        if dist.get_rank() == 0:
            _assert_state_equal(got, ref, exact=True)
        else:
            assert got == {"model": {}, "optim": {}}   # cpu_offload + full: only rank 0 holds them
        # without cpu_offload every rank gets the full tensors; the sharded default keeps DTensors
        full_all = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        assert all(torch.equal(full_all[k], v) for k, v in ref["model"].items())
        sharded = get_optimizer_state_dict(model, opt)
        assert isinstance(sharded["state"]["layers.0.attention.wq.weight"]["exp_avg"], hp.DTensor)
    return True


def _fsdp_full_and_midstep_body(root, layouts):
    """FSDP layouts: full / broadcast state dicts in, and state dicts taken in the middle of a step.

    After forward the root ``fully_shard`` group is still unsharded (its modules hold the
    unsharded tensors, the optimizer the sharded ones): the optimizer state dict (asked
    for first, before the model's state_dict hook reshards) must still be keyed by FQN and
    equal the checkpoint, and the step must go on to the uninterrupted run's losses/state.
    """
    ref = torch.load(os.path.join(root, "single_ref.pt"))
    for layout in layouts:
        _full_and_broadcast_body(root, layout)
        model, opt, mesh = _build(layout)
        held = ref["at_save"] if dist.get_rank() == 0 else {"model": {}, "optim": {}}
        set_state_dict(model, opt, model_state_dict=held["model"], optim_state_dict=held["optim"],
                       options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        seen = []

        def mid_step(module, args, out):
            if not seen:   # once, in the first step's forward (after fully_shard's own post-forward hook)
                stepped = {id(p) for g in opt.param_groups for p in g["params"]}
                assert any(id(p) not in stepped for p in module.parameters()), "root group is not unsharded"
                osd = get_optimizer_state_dict(module, opt, options=FULL)
                msd = get_model_state_dict(module, options=FULL)
                seen.append({"model": msd, "optim": osd})
        handle = model.register_forward_hook(mid_step)
        losses = _train(model, opt, mesh, SAVE_AT, MORE)
        handle.remove()
        after = _full(model, opt)
        if dist.get_rank() == 0:
            _assert_state_equal(seen[0], ref["at_save"], exact=True)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
            _assert_state_equal(after, ref["after"], exact=False)
    return True


_OFFLINE = r"""
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from dataclasses import replace
from examples.llama.configs import get_config
from examples.llama.model import build_model
cfg = get_config("tiny"); cfg = replace(cfg, model=replace(cfg.model, n_kv_heads=4))
sd = torch.load(sys.argv[2])
ref = torch.load(sys.argv[3])["at_save"]
model = build_model(cfg.model, cfg.seed)
model.load_state_dict(sd["model"])
for k, v in model.state_dict().items():
    assert torch.equal(v, ref["model"][k]), k
for fqn, st in ref["optim"]["state"].items():
    for k, v in st.items():
        assert torch.equal(sd["optim"]["state"][fqn][k], v), (fqn, k)
assert not dist.is_initialized()
print("offline ok", sd["step"])
"""


def test_llama_resharding_matrix(dist_runner, tmp_path):
    root = str(tmp_path)
    assert dist_runner.run(1, _save_body, root, ["single"]) == [True]
    assert dist_runner.run(2, _save_body, root, ["tp2"]) == [True] * 2
    assert dist_runner.run(4, _save_body, root, ["tp4", "dp2tp2", "fsdp4", "fsdp2tp2", "hsdp"]) == [True] * 4
    assert dist_runner.run(1, _load_body, root, [("tp4", "single"), ("fsdp2tp2", "single")]) == [True]
    assert dist_runner.run(2, _load_body, root, [("dp2tp2", "tp2"), ("fsdp4", "tp2"), ("hsdp", "tp2")]) == [True] * 2
    assert dist_runner.run(2, _full_and_broadcast_body, root) == [True] * 2
    assert dist_runner.run(4, _load_body, root, [("single", "tp4"), ("tp2", "dp2tp2"), ("dp2tp2", "dp2tp2"),
                                                 ("single", "fsdp4"), ("tp2", "fsdp2tp2"), ("tp2", "hsdp")]) \
        == [True] * 4
    assert dist_runner.run(4, _fsdp_full_and_midstep_body, root, ["fsdp2tp2", "hsdp"]) == [True] * 4

    # offline: the TP 4 checkpoint as one torch.save file, loaded without torch.distributed
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = tmp_path / "tp4.pt"
    dcp_to_torch_save(ckpt.latest_dir(os.path.join(root, "tp4")), str(out))
    r = subprocess.run([sys.executable, "-c", _OFFLINE, ROOT, str(out), os.path.join(root, "tp4_ref.pt")],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and "offline ok 2" in r.stdout, r.stdout + r.stderr


def _train_cli(tmp_path, nproc, *args):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] \
        if nproc > 1 else [sys.executable]
    cmd = launcher + [os.path.join(ROOT, "examples", "llama", "train.py"), "--config", "tiny", "--no-compare",
                      *map(str, args)]
    r = run_launch(cmd, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, " ".join(cmd) + "\n" + (r.stdout + r.stderr)[-5000:]
    return r.stdout


def test_train_cli_resume_other_layout(tmp_path):
    """train.py --checkpoint-dir/--save-every under FSDP 2 x TP 2, then --resume in one process from step 2."""
    from examples.llama.plot import read_loss_csv
    d = tmp_path / "ck"
    _train_cli(tmp_path, 4, "--dp-shard", "2", "--tp", "2", "--steps", "4", "--save-every", "2",
               "--checkpoint-dir", d, "--out", tmp_path / "a")
    assert sorted(os.listdir(d)) == ["latest", "step-000002", "step-000004"]
    assert (d / "latest").read_text().strip() == "step-000004"
    (d / "latest").write_text("step-000002\n")        # resume from the middle
    out = _train_cli(tmp_path, 1, "--steps", "4", "--resume", "--checkpoint-dir", d, "--out", tmp_path / "b")
    assert "resumed from" in out and "after step 2" in out, out
    full = list(read_loss_csv(tmp_path / "a.csv").values())[0]
    resumed = list(read_loss_csv(tmp_path / "b.csv").values())[0]
    assert len(full) == 4 and len(resumed) == 2
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[2:]), rtol=1e-5, atol=0)
