"""Subprocess launches of the examples (torchrun), shared by the end-to-end tests.

A launch used to be retried once when a process aborted at interpreter exit with "terminate
called without an active exception" (about once in 10-20 launches on a loaded machine). The
cause was found and fixed: a gloo worker thread freed Python tensors after the interpreter
had begun finalizing, because the process groups outlived ``destroy_process_group`` (the
library's group cache held them). hyper_parallel now destroys and frees them in an ``atexit``
hook (``hyper_parallel/distributed/launch.py``; docs/testing.md, "The gloo abort at exit"),
so every failure fails the test.
"""
from __future__ import annotations

import subprocess

TEARDOWN_ABORT = "terminate called without an active exception"


def run_launch(cmd, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)`` (no retry)."""
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def torchrun(script, nproc: int, *args, timeout: float = 300) -> str:
    """``python -m torch.distributed.run --standalone --nproc_per_node nproc script args`` from the repository root
    (one thread per process, no inherited rank variables); fails the test on a timeout or a non-zero exit and
    returns the stdout."""
    import os
    import sys
    from pathlib import Path

    import pytest
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(root / script), *map(str, args)]
    try:
        proc = run_launch(cmd, cwd=root, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} did not finish within {timeout}s; output so far:\n{exc.stdout}\n{exc.stderr}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-6000:]}"
    return proc.stdout
