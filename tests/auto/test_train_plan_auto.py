"""examples/llama/train.py --plan auto under torchrun with 4 CPU processes: it calibrates, plans, prints the
plan, trains with it and matches the single-process run (the example's own comparison)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.launch import run_launch

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 400


def _torchrun(nproc, *args):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / "examples/llama/train.py"), *map(str, args)]
    try:
        proc = run_launch(cmd, cwd=ROOT, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"train.py did not finish within {TIMEOUT}s; output so far:\n{exc.stdout}\n{exc.stderr}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-6000:]}"
    return proc.stdout


@pytest.mark.parametrize("config", ["tiny", "moe-tiny"])
def test_train_plan_auto_matches_one_process(tmp_path, config):
    out = _torchrun(4, "--plan", "auto", "--config", config, "--steps", "3", "--out", tmp_path / "loss",
                    "--device-memory", "4GiB")
    assert "--plan auto: calibrated 4 devices" in out, out
    assert re.search(r"plan: .*\(world 4, batch 8 x 32\)", out), out
    assert "--plan auto: training with" in out, out
    m = re.search(r"largest loss difference vs single process: (\S+) \(relative (\S+)\)", out)
    assert m, out
    assert float(m.group(1)) < 1e-4 and float(m.group(2)) < 1e-4, out
