"""examples/llama/train.py --plan auto under torchrun with 4 CPU processes: it calibrates, plans, prints the
plan, trains with it and matches the single-process run (the example's own comparison)."""
import re

import pytest

from tests.harness.launch import torchrun

TIMEOUT = 400


def _torchrun(nproc, *args):
    return torchrun("examples/llama/train.py", nproc, *args, timeout=TIMEOUT)


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
