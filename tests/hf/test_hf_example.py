"""``examples/hf/train.py`` end to end under torchrun (as a user runs it): a preset under a hand-written layout on 4
ranks, and a saved checkpoint directory under ``--plan auto`` on 2 ranks; both print the comparison with one
process and exit 0 (the script exits 1 above its tolerance)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.launch import run_launch

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def _torchrun(n, *args):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           str(ROOT / "examples" / "hf" / "train.py"), *map(str, args)]
    try:
        proc = run_launch(cmd, cwd=ROOT, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"examples/hf/train.py did not finish within {TIMEOUT}s:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return proc.stdout


def _differences(out):
    m = re.search(r"largest relative difference vs one process: loss (\S+), grad norm (\S+)", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


def test_example_trains_a_preset_with_tp_sp_fsdp_like_one_process():
    out = _torchrun(4, "--config", "llama-tiny", "--dp-shard", "2", "--tp", "2", "--sp", "--steps", "3")
    assert "plan: fsdp2 x tp2 +sp" in out
    assert len(re.findall(r"^step \d+: loss", out, re.M)) == 3
    assert max(_differences(out)) < 1e-9


def test_example_trains_a_saved_checkpoint_under_plan_auto(tmp_path):
    from examples.hf.presets import build_model
    build_model("qwen3-tiny", seed=3).save_pretrained(tmp_path / "ckpt")
    out = _torchrun(2, "--config", tmp_path / "ckpt", "--plan", "auto", "--steps", "2")
    assert "plan: " in out and "step 2: loss" in out
    assert max(_differences(out)) < 1e-9
