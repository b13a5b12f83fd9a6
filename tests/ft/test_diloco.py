"""DiLoCo across 2 replica groups (torchft's ``DiLoCo``, H = 8) against synchronous training of the same steps.

Both runs: 2 groups of one rank each (``train.py --ft-*``, a real lighthouse each, the default
``min_replicas``: a majority, here both groups), 80 steps of the tiny config. Counted: the bytes each
rank sends into cross-group all_reduces (``hyper_parallel.ft.CrossGroupBytes``, around
``manager.allreduce``, which both paths use). DiLoCo must send at most 1/8 of the synchronous bytes per
step, and its loss after 80 steps (the mean of both groups' losses over the last sync period, H steps:
one step's batch alone is noisier than the 5% asked) be within 5% of the synchronous run's.
"""
import time

import pytest

from hyper_parallel.ft.lighthouse import Lighthouse
from tests.ft.groups import Group, committed

STEPS, H = 80, 8
BASE = ["--config", "tiny", "--steps", str(STEPS), "--dp-shard", "1", "--ft-num-replica-groups", "2",
        "--ft-timeout", "30", "--no-compare"]


def _run(lh, tmp_path, name, extra):
    return [Group(g, 1, lh.address, tmp_path / f"{name}{g}.jsonl", BASE + extra) for g in (0, 1)]


@pytest.mark.timeout(600)
def test_diloco_h8_bytes_and_loss(tmp_path):
    deadline = time.monotonic() + 480
    with Lighthouse(min_replicas=2, heartbeat_timeout_ms=5000, join_timeout_ms=5000) as lh_sync, \
            Lighthouse(min_replicas=2, heartbeat_timeout_ms=5000, join_timeout_ms=5000) as lh_dl:
        runs = {"sync": _run(lh_sync, tmp_path, "sync", []),
                "diloco": _run(lh_dl, tmp_path, "diloco", ["--ft-semi-sync", "diloco", "--sync-every", str(H)])}
        try:
            for groups in runs.values():
                for g in groups:
                    assert g.wait(deadline) == [0], g.output()
        finally:
            for groups in runs.values():
                for g in groups:
                    g.kill()
    result = {}
    for name, groups in runs.items():
        recs = [committed(g.records()) for g in groups]
        assert all([r["step"] for r in rs] == list(range(STEPS)) for rs in recs), name
        per_step = max(rs[-1]["bytes"] for rs in recs) / STEPS
        loss = sum(r["loss"] for rs in recs for r in rs[-H:]) / (H * len(recs))  # the last sync period
        result[name] = (per_step, loss)
    (sync_bytes, sync_loss), (dl_bytes, dl_loss) = result["sync"], result["diloco"]
    print(f"\nDiLoCo H={H}: {dl_bytes:,.0f} cross-group bytes per step vs synchronous {sync_bytes:,.0f} "
          f"(ratio {dl_bytes / sync_bytes:.4f}); loss after {STEPS} steps {dl_loss:.4f} vs {sync_loss:.4f} "
          f"({(dl_loss - sync_loss) / sync_loss:+.2%})")
    assert sync_bytes > 0 and dl_bytes <= sync_bytes / H
    assert abs(dl_loss - sync_loss) <= 0.05 * sync_loss
