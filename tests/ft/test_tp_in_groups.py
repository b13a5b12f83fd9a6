"""TP inside replica groups: 2 groups of FSDP-1 x TP-2 (torchft across the groups) match one process.

The replicate dim's all-reduce hook runs on the FSDP modules' reduced shards of TP-sharded (2-D
layout) parameters; every rank of both groups must hold bit-identical state at every step, and the
mean of the groups' losses must equal one process training the same global batches.
"""
import time

import pytest

from hyper_parallel.ft.lighthouse import Lighthouse
from tests.ft.groups import Group, committed, reference_losses

STEPS, CONFIG = 6, "tiny"


@pytest.mark.timeout(400)
def test_two_tp_groups_match_one_process(tmp_path):
    argv = ["--config", CONFIG, "--steps", str(STEPS), "--tp", "2", "--ft-num-replica-groups", "2"]
    deadline = time.monotonic() + 300
    with Lighthouse(min_replicas=2, heartbeat_timeout_ms=5000, join_timeout_ms=5000) as lh:
        groups = [Group(g, 2, lh.address, tmp_path / f"g{g}.jsonl", argv) for g in (0, 1)]
        try:
            for g in groups:
                assert g.wait(deadline) == [0, 0], g.output()
        finally:
            for g in groups:
                g.kill()
    for rank in (0, 1):
        recs = [committed(g.records(rank)) for g in groups]
        assert all([r["step"] for r in rs] == list(range(STEPS)) for rs in recs)
        assert [r["digest"] for r in recs[0]] == [r["digest"] for r in recs[1]], rank
    ref = reference_losses(CONFIG, STEPS)
    mean = [(a["loss"] + b["loss"]) / 2 for a, b in zip(*(committed(g.records()) for g in groups))]
    for step, (got, want) in enumerate(zip(mean, ref)):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
