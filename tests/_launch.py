"""Subprocess launches of the examples (torchrun), shared by the end-to-end tests.

On a heavily loaded machine, a torchrun launch of torch 2.13 on gloo occasionally loses one
process at interpreter exit: "terminate called without an active exception" and SIGABRT, after
the script's work and output are complete (seen about once in 10-20 launches at load average > 10,
with and without hyper_parallel's FSDP; not reproduced on an idle machine). That is a teardown
race in the C++ runtime, not a wrong result, so such a launch is retried once; any other failure,
or the same abort twice, fails the test.
"""
from __future__ import annotations

import subprocess

TEARDOWN_ABORT = "terminate called without an active exception"


def run_launch(cmd, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``, retried once after a teardown abort."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0 and TEARDOWN_ABORT in proc.stdout + proc.stderr:
        proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    return proc
