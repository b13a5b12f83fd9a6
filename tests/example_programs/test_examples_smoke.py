"""The runnable examples, end to end under torchrun with 4 CPU processes (as a user runs them).

* ``examples/llama/train.py --dp-shard 2 --tp 2 --sp`` (the command behind scripts/demo.sh: FSDP x TP)
  on the tiny config for 2 steps: exit code 0, the loss curve files, the printed largest loss
  difference against the single-process run, and the per-rank state bytes (about a quarter of the
  unsharded total).
* ``examples/dtensor_demo.py``: exit code 0, the collectives it prints for the moves the README
  describes, and its own check of every shard and full_tensor() against the full tensor.
"""
import math
import re


from examples.llama.plot import read_loss_csv

from tests.harness.launch import torchrun

TIMEOUT = 300  # generous: 4 processes on a loaded 2-core machine; ~10 s each when idle


def _torchrun(script, *args):
    return torchrun(script, 4, *args, timeout=TIMEOUT)


def test_train_llama_dp_shard2_tp2_sp(tmp_path):
    prefix = tmp_path / "loss"
    out = _torchrun("examples/llama/train.py", "--dp-shard", "2", "--tp", "2", "--sp", "--steps", "2",
                    "--config", "tiny", "--out", prefix)
    assert "dp=1 dp_shard=2 tp=2 sp=on, 2 steps" in out, out
    m = re.search(r"per-rank parameter\+gradient\+optimizer bytes: (.*) \(unsharded total ([\d,]+)\)", out)
    assert m, out
    per_rank = [int(b.replace(",", "")) for b in re.findall(r"rank \d: ([\d,]+)", m.group(1))]
    total = int(m.group(2).replace(",", ""))
    assert len(per_rank) == 4 and all(total / 4 <= b <= total / 4 * 1.01 for b in per_rank), (per_rank, total)
    assert re.search(r"step 2/2 +loss \d+\.\d{4} +[\d,]+ tok/s", out), out
    m = re.search(r"largest loss difference vs single process: (\S+) \(relative (\S+)\)", out)
    assert m, out
    diff, rel = float(m.group(1)), float(m.group(2))
    assert diff < 1e-4 and rel < 1e-4, (diff, rel)

    csv = prefix.with_suffix(".csv")
    assert f"loss curve written to {csv}" in out, out  # into tmp_path, not the repository
    assert csv.is_file(), out
    series = read_loss_csv(csv)
    assert set(series) == {"dp1_dpshard2_tp2_sp", "single_process"}, series
    for name, losses in series.items():
        assert len(losses) == 2 and all(math.isfinite(v) and 0 < v < 10 for v in losses), (name, losses)
    for a, b in zip(series["dp1_dpshard2_tp2_sp"], series["single_process"]):
        assert abs(a - b) <= 1e-4 * abs(b), series
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    png = prefix.with_suffix(".png")
    assert png.is_file() and png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dtensor_demo():
    out = _torchrun("examples/dtensor_demo.py")
    sections = {}
    for block in out.split("\n== ")[1:]:
        head, *lines = block.splitlines()
        title, _, rest = head.partition(": placements ")
        sections[title] = (rest, [ln.strip() for ln in lines if ln.strip().startswith("rank ")])
    assert len(sections) == 7, out
    for title, (rest, ranks) in sections.items():
        assert "; collectives " in rest, (title, rest)
        assert [r.split(":")[0] for r in ranks] == [f"rank {i}" for i in range(4)], (title, ranks)
    # the moves the README and the demo's docstring describe
    assert sections["rows over dp, columns over tp"][0].endswith("collectives none")  # Replicate -> Shard
    assert sections["alias spelling: dim 0 over (dp, tp)"][0].endswith("collectives {'all_to_all': 1}")
    partial = next(v for k, v in sections.items() if k.startswith("Partial sums"))
    assert partial[0].endswith("collectives {'reduce_scatter': 2}"), partial[0]
    assert all(r.endswith("[10.0, 10.0, 10.0, 10.0]") for r in partial[1]), partial[1]
    assert sections["replicated everywhere"][1][3].endswith(str([float(i) for i in range(16)])), out
    assert "all 7 layouts checked: every shard and full_tensor() match the full tensor" in out, out
