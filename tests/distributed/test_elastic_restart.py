"""Elastic restart of the example trainer under torchrun (issue 26, item 1).

``torchrun --max-restarts 1 --rdzv-backend c10d ... train.py --checkpoint-dir D --save-every 2
--resume`` on 2 processes (tp 2, tiny config, 8 steps); ``HP_TEST_KILL_AT_STEP=1:3`` makes rank 1
SIGKILL itself in step 3 of the first attempt, after forward and backward. torchrun restarts the
group, ``--resume`` loads ``step-000002`` and the run completes. Its final checkpoint (model and
AdamW state) and its losses of steps 3-8 are bit-exact against an uninterrupted run of the same
command line (which starts fresh: ``--resume`` without a checkpoint).

Issue 33, item 1: with ``--dropout 0.1`` (embeddings, residual branches, attention weights), at
``--tp 2`` and at ``--dp-shard 2``, rank 1 is killed after the step-4 checkpoint of a 6-step run;
besides losses, parameters and AdamW state, every rank's generator state (``rng/<rank>/cpu``) and
the DTensor random stream (``dtensor_rng``) of the final checkpoint equal the uninterrupted run's.
Before, they differed: torch 2.13 seeds each new process's generator at random, and the trainer
did not seed it (the restored state was right, the uninterrupted run's was another one).

Without the restart-safe store of ``hyper_parallel/distributed/launch.py`` the restarted
round fails in gloo's ``connectFullMesh`` (stale peer addresses in torchrun's shared store;
``tools/elastic_repro.py`` shows it in plain torch).
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from examples.llama import checkpoint as ckpt
from examples.llama.configs import get_config
from examples.llama.model import build_model
from examples.llama.plot import read_loss_csv
from examples.llama.reference import build_optimizer

from tests.harness.launch import run_launch

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAYOUTS = {"tp2": (["--tp", "2"], "dp1_tp2"), "dpshard2": (["--dp-shard", "2"], "dp1_dpshard2_tp1")}
STEPS, EVERY, KILL = 6, 2, "1:5"  # rank 1 dies in step 5, after the step-4 checkpoint


def _train(tmp, name, kill=None, layout="tp2", extra=()):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HP_TEST_KILL_AT_STEP")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if kill:
        env["HP_TEST_KILL_AT_STEP"] = kill
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--monitor-interval", "0.2",
           str(ROOT / "examples/llama/train.py"), *LAYOUTS[layout][0], "--config", "tiny", "--steps", str(STEPS),
           "--checkpoint-dir", str(tmp / name), "--save-every", str(EVERY), "--resume", "--no-compare",
           "--out", str(tmp / f"{name}-loss"), *extra]
    try:
        proc = run_launch(cmd, cwd=ROOT, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{name}: torchrun did not finish within {TIMEOUT}s:\n{exc.stdout}\n{exc.stderr}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name}: torchrun exited with {proc.returncode}:\n{out[-8000:]}"
    return out


def _final_state(root, step=STEPS):
    cfg = get_config("tiny")
    model = build_model(cfg.model, cfg.seed)
    opt = build_optimizer(model.parameters(), cfg.optim)
    assert ckpt.load(ckpt.step_dir(str(root), step), model, opt, data_seed=cfg.seed) == step
    return model.state_dict(), opt.state_dict()


def _saved_rng(root, step=STEPS):
    """Every generator state of a checkpoint: ``rng/<rank>/cpu`` tensors and the ``dtensor_rng`` seed/offset."""
    path = ckpt.step_dir(str(root), step)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(md.size), dtype=torch.uint8) for k, md in saved.items() if k.startswith("rng/")}
    state[ckpt.DTENSOR_RNG] = {"seed": "", "offset": -1}
    dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    return state


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_killed_rank_restarts_and_matches_uninterrupted_run(tmp_path, layout):
    extra = ("--dropout", "0.1")
    out = _train(tmp_path, "plain", layout=layout, extra=extra)
    assert "resumed from (none) after step 0" in out, out[-4000:]  # --resume with nothing saved: a fresh start
    out_k = _train(tmp_path, "killed", kill=KILL, layout=layout, extra=extra)
    assert "HP_TEST_KILL_AT_STEP: rank 1 kills itself in step 5" in out_k, out_k[-4000:]
    assert f"resumed from {tmp_path / 'killed' / 'step-000004'} after step 4" in out_k, out_k[-4000:]
    assert "trained 2 steps" in out_k, out_k[-4000:]

    series = LAYOUTS[layout][1]
    ref_losses = read_loss_csv(tmp_path / "plain-loss.csv")[series]
    losses = read_loss_csv(tmp_path / "killed-loss.csv")[series]
    assert len(ref_losses) == STEPS and losses == ref_losses[4:], (losses, ref_losses)  # exact floats

    # every generator state, both ranks, and the DTensor stream's (seed, offset)
    ref_rng, got_rng = _saved_rng(tmp_path / "plain"), _saved_rng(tmp_path / "killed")
    assert sorted(k for k in ref_rng if k.startswith("rng/")) == ["rng/0/cpu", "rng/1/cpu"], sorted(ref_rng)
    assert ref_rng.keys() == got_rng.keys()
    for k in ref_rng:
        if k.startswith("rng/"):
            assert torch.equal(ref_rng[k], got_rng[k]), k
    assert ref_rng[ckpt.DTENSOR_RNG] == got_rng[ckpt.DTENSOR_RNG] == {"seed": "0", "offset": 0}
    # the dropout did draw: the generators moved between the step-4 and the final checkpoint
    mid = _saved_rng(tmp_path / "plain", 4)
    assert not torch.equal(mid["rng/1/cpu"], ref_rng["rng/1/cpu"])

    (ref_m, ref_o), (got_m, got_o) = _final_state(tmp_path / "plain"), _final_state(tmp_path / "killed")
    assert ref_m.keys() == got_m.keys()
    for k in ref_m:
        assert torch.equal(ref_m[k], got_m[k]), k
    assert ref_o["state"].keys() == got_o["state"].keys()
    for i, st in ref_o["state"].items():
        for name, v in st.items():
            assert torch.equal(v, got_o["state"][i][name]), (i, name)


def test_latest_dir_never_picks_a_directory_without_metadata(tmp_path):
    assert ckpt.latest_dir(str(tmp_path / "absent")) is None
    for step, complete in ((2, True), (4, True), (6, False)):
        d = Path(ckpt.step_dir(str(tmp_path), step))
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x")
        if complete:
            (d / ".metadata").write_bytes(b"x")
    (tmp_path / "latest").write_text("step-000006\n")  # even a marker naming the torn one is not followed
    assert ckpt.latest_dir(str(tmp_path)) == ckpt.step_dir(str(tmp_path), 4)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.load(ckpt.step_dir(str(tmp_path), 6), None, None)
