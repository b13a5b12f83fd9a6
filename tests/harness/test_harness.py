"""Tests of the multi-process harness itself (plain torch.distributed, gloo)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import (
    DistributedTestError,
    DistributedTimeoutError,
    get_pool,
    requires_world_size,
    run_distributed,
)


# ---------------------------------------------------------------- rank bodies
# (module level: they are pickled by reference and imported by the workers)

def _allreduce_rank_values(scale):
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((3,), float(rank + 1)) * scale
    dist.all_reduce(t)
    expected = scale * world * (world + 1) / 2
    assert torch.equal(t, torch.full((3,), expected)), (rank, t, expected)
    return {"rank": rank, "world": world, "value": t}


def _env_and_threads():
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "env": {k: os.environ.get(k) for k in
                ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")},
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


def _kwargs_echo(a, b=0, *, c=None):
    return (dist.get_rank(), a, b, c)


def _raise_on_rank(bad_rank, message):
    if dist.get_rank() == bad_rank:
        raise ValueError(message)
    # the other ranks block in a collective that can never complete
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _all_ranks_assert():
    rank = dist.get_rank()
    assert rank < 0, f"assertion text from rank {rank}"


def _exit_on_rank(bad_rank, code):
    if dist.get_rank() == bad_rank:
        os._exit(code)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _sleep_on_rank(slow_rank, seconds):
    if dist.get_rank() == slow_rank:
        time.sleep(seconds)
    return dist.get_rank()


def _install_fake_reset_hook():
    """Put a stand-in `hyper_parallel.dispatch.modes` with a `reset_process_state` into sys.modules.

    The hook records that it ran and puts the original module back, so the
    worker is left exactly as it was."""
    import sys
    import types

    import hyper_parallel  # noqa: F401  (the hook runs only when the package is loaded)

    name = "hyper_parallel.dispatch.modes"
    original = sys.modules.get(name)
    fake = types.ModuleType(name)

    def reset_process_state():
        os.environ["HP_TEST_RESET_CALLS"] = str(int(os.environ.get("HP_TEST_RESET_CALLS", 0)) + 1)
        if original is None:
            del sys.modules[name]
        else:
            sys.modules[name] = original

    fake.reset_process_state = reset_process_state
    fake._hp_fake = True
    sys.modules[name] = fake
    return os.environ.get("HP_TEST_RESET_CALLS", "0")


def _reset_calls():
    import sys

    mod = sys.modules.get("hyper_parallel.dispatch.modes")
    return os.environ.get("HP_TEST_RESET_CALLS", "0"), not getattr(mod, "_hp_fake", False)


# ----------------------------------------------------------------------- tests

@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_all_reduce_sum(dist_runner, world_size):
    out = dist_runner.run(world_size, _allreduce_rank_values, 2.0)
    assert len(out) == world_size
    expected = 2.0 * world_size * (world_size + 1) / 2
    for rank, res in enumerate(out):
        assert res["rank"] == rank and res["world"] == world_size
        assert torch.equal(res["value"], torch.full((3,), expected))


def test_worker_environment(dist_runner):
    out = dist_runner.run(2, _env_and_threads)
    port = out[0]["env"]["MASTER_PORT"]
    assert len({o["pid"] for o in out}) == 2 and os.getpid() not in {o["pid"] for o in out}
    for rank, o in enumerate(out):
        assert o["backend"] == "gloo"
        assert o["threads"] == 1
        assert o["env"] == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}


def test_pool_is_reused_and_fast(dist_runner):
    pids = dist_runner.run(4, _env_and_threads)
    t0 = time.perf_counter()
    for _ in range(20):
        again = dist_runner.run(4, _env_and_threads)
    per_task = (time.perf_counter() - t0) / 20
    assert [o["pid"] for o in again] == [o["pid"] for o in pids]
    assert per_task < 0.5, f"round trip {per_task * 1e3:.1f} ms"


def test_args_and_kwargs(dist):
    assert dist.run(2, _kwargs_echo, "x", b=[1, 2], c={"k": 3}) == [
        (0, "x", [1, 2], {"k": 3}), (1, "x", [1, 2], {"k": 3})]


def test_rank_exception_reported_while_others_stuck(dist_runner):
    dist_runner.run(4, _env_and_threads)  # warm pool: time only the failure
    old_pids = get_pool(4).pids
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as excinfo:
        dist_runner.run(4, _raise_on_rank, 2, "boom from the bad rank")
    elapsed = time.monotonic() - t0
    assert isinstance(excinfo.value, DistributedTestError)
    msg = str(excinfo.value)
    assert "--- rank 2 raised ---" in msg
    assert "Traceback (most recent call last)" in msg
    assert "ValueError: boom from the bad rank" in msg
    assert "in _raise_on_rank" in msg
    assert "did not finish" in msg  # the stuck ranks are named
    assert elapsed < 20, elapsed

    # (c) the next task gets a fresh, working pool
    out = dist_runner.run(4, _allreduce_rank_values, 1.0)
    assert [o["value"][0].item() for o in out] == [10.0] * 4
    assert set(get_pool(4).pids).isdisjoint(old_pids)


def test_every_failing_rank_is_reported(dist_runner):
    with pytest.raises(AssertionError) as excinfo:
        dist_runner.run(2, _all_ranks_assert)
    msg = str(excinfo.value)
    for rank in range(2):
        assert f"--- rank {rank} raised ---" in msg
        assert f"assertion text from rank {rank}" in msg
    assert dist_runner.run(2, _kwargs_echo, 1) == [(0, 1, 0, None), (1, 1, 0, None)]


def test_worker_death_reported(dist_runner):
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as excinfo:
        dist_runner.run(2, _exit_on_rank, 1, 7)
    assert time.monotonic() - t0 < 20
    assert "rank 1 died (exit code 7)" in str(excinfo.value)
    assert dist_runner.run(2, _kwargs_echo, 5)[1] == (1, 5, 0, None)


def test_timeout_names_stuck_ranks():
    with pytest.raises(DistributedTimeoutError) as excinfo:
        run_distributed(2, _sleep_on_rank, 1, 60, timeout=2)
    msg = str(excinfo.value)
    assert "ranks [1] did not finish" in msg
    assert "_sleep_on_rank" in msg  # stack dump of the stuck rank
    assert run_distributed(2, _sleep_on_rank, 1, 0) == [0, 1]


def test_unpicklable_fn_is_rejected_in_parent():
    with pytest.raises(TypeError, match="module-level"):
        run_distributed(1, lambda: 1)


@requires_world_size(16)
def test_requires_world_size_skips_large():
    raise AssertionError("must be skipped with the default HP_TEST_MAX_WORLD_SIZE=8")


def test_cleanup_hook_runs_between_tasks(dist_runner):
    before = dist_runner.run(2, _install_fake_reset_hook)
    after = dist_runner.run(2, _reset_calls)
    for b, (calls, fake_gone) in zip(before, after):
        assert int(calls) == int(b) + 1
        assert fake_gone
