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
