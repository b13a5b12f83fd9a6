"""Bad input to a torchft job: clear errors in bounded time, never a hang.

* no lighthouse at the address: ``ConnectionError`` naming it, within the connect timeout, before
  anything waits on a store;
* a replica group id out of range (the library and train.py's flags);
* two groups with different models, or the same model under different inner layouts (real
  processes, a real lighthouse): every group stops with an error saying the groups do not hold the
  same model, in bounded time; no step is committed and a group that heals from a group with other
  layouts does not load a different piece of each tensor.
"""
import time

import pytest

from hyper_parallel.ft import make_manager
from hyper_parallel.ft.lighthouse import Lighthouse, check_reachable, free_port
from tests.ft.groups import Group


def test_no_lighthouse_reachable_is_a_clear_error_in_bounded_time(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"no torchft lighthouse reachable at '{addr}' within 1 s"):
        make_manager(replica_group_id=0, num_replica_groups=2, lighthouse=addr, connect_timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError, match="expected 'HOST:PORT' or 'http://HOST:PORT'"):
        check_reachable("localhost")


def test_group_id_out_of_range():
    for gid in (2, -1):
        with pytest.raises(ValueError, match=rf"replica_group_id={gid} is out of range: expected an int in \[0, 2\)"):
            make_manager(replica_group_id=gid, num_replica_groups=2, lighthouse="127.0.0.1:1")
    with pytest.raises(ValueError, match=r"min_replicas=3: expected an int in \[1, 2\]"):
        make_manager(replica_group_id=0, num_replica_groups=2, lighthouse="127.0.0.1:1", min_replicas=3)
    from examples.llama.fault_tolerant import check_ft_args
    from examples.llama.train import parse_args
    args = parse_args(["--ft-replica-group-id", "3", "--ft-num-replica-groups", "2", "--ft-lighthouse", "x:1"])
    with pytest.raises(SystemExit, match="--ft-replica-group-id 3 is out of range: expected 0 <= G < "
                                         "--ft-num-replica-groups 2"):
        check_ft_args(args, 1)


# (group 0's ranks, its flags), (group 1's ranks, its flags): another model; the same model under another inner
# layout (FSDP 2 vs TP 2, two ranks each: rank r holds a different piece of each weight, see docs/fault_tolerance.md)
CASES = {"other_model": ((1, ["--dp-shard", "1", "--config", "tiny"]), (1, ["--dp-shard", "1", "--config", "moe-tiny"])),
         "other_layout": ((2, ["--dp-shard", "2", "--config", "tiny"]), (2, ["--tp", "2", "--config", "tiny"]))}


@pytest.mark.timeout(300)
def test_mismatched_groups_fail_clearly(tmp_path):
    argv = ["--steps", "5", "--ft-num-replica-groups", "2", "--ft-timeout", "10", "--ft-quorum-timeout", "30"]
    deadline = time.monotonic() + 240
    lighthouses = {case: Lighthouse(min_replicas=2, heartbeat_timeout_ms=2000, join_timeout_ms=2000).start()
                   for case in sorted(CASES)}
    jobs = {}
    try:
        for case, lh in lighthouses.items():  # both cases at once: each waits mostly on process start-up
            jobs[case] = [Group(g, ranks, lh.address, tmp_path / f"{case}{g}.jsonl", argv + flags)
                          for g, (ranks, flags) in enumerate(CASES[case])]
        codes = {case: [g.wait(deadline) for g in groups] for case, groups in jobs.items()}
    finally:
        for groups in jobs.values():
            for g in groups:
                g.kill()
        for lh in lighthouses.values():
            lh.stop()
    for case, groups in jobs.items():
        for g, code in zip(groups, codes[case]):
            assert all(c != 0 for c in code), (case, g.output())
            assert "same model" in g.output(), (case, g.output())
            assert not any(r["committed"] for r in g.records()), f"{case}: a step was committed with mismatched groups"
