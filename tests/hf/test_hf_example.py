"""``examples/hf/train.py`` end to end under torchrun (as a user runs it): a preset under a hand-written layout on 4
ranks, and a saved checkpoint directory under ``--plan auto`` on 2 ranks; both print the comparison with one
process and exit 0 (the script exits 1 above its tolerance)."""
import re

from tests.harness.launch import torchrun


def _torchrun(n, *args):
    return torchrun("examples/hf/train.py", n, *args)


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
