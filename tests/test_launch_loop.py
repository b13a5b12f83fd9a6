"""A short loop of torchrun launches on gloo without an abort at exit (issue 26, item 4).

``tools/launch_loop.py`` runs ``tools/gloo_exit_repro.py --hp`` (a hyper_parallel mesh, DTensor
ops, a final barrier, no explicit destroy: the library's exit hook tears the groups down) 5 times
with a CPU hog alive, and fails on any abort ("terminate called without an active exception") or
other failure. The 50-launch figure is in docs/testing.md.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_five_launches_without_an_abort():
    cmd = [sys.executable, str(ROOT / "tools/launch_loop.py"), "--n", "5", "--nproc", "2", "--hog", "1",
           "--timeout", "200", str(ROOT / "tools/gloo_exit_repro.py"), "--hp"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert "launch_loop: 5 launches, 0 aborts, 0 other failures" in out and proc.returncode == 0, out[-6000:]
