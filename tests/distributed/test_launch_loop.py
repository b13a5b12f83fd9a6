"""A short loop of torchrun launches on gloo without an abort at exit (issue 26, item 4).

``tools/launch_loop.py`` runs ``tools/gloo_exit_repro.py --hp`` (a hyper_parallel mesh, DTensor
ops, a final barrier, no explicit destroy: the library's exit hook tears the groups down) 5 times
with a CPU hog alive, and fails on any abort ("terminate called without an active exception") or
other failure. The 50-launch figure is in docs/testing.md.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_five_launches_without_an_abort():
    cmd = [sys.executable, str(ROOT / "tools/launch_loop.py"), "--n", "5", "--nproc", "2", "--hog", "1",
           "--timeout", "200", str(ROOT / "tools/gloo_exit_repro.py"), "--hp"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert "launch_loop: 5 launches, 0 aborts, 0 other failures" in out and proc.returncode == 0, out[-6000:]


_EXIT_THREADS = r"""
import atexit, glob, os, sys
def gloo_threads():
    names = []
    for t in glob.glob("/proc/self/task/*/comm"):
        try:
            names.append(open(t).read().strip())
        except OSError:
            pass
    return sum(n.startswith(("pt_gloo", "gloo_")) for n in names)
atexit.register(lambda: print("gloo threads at teardown:", gloo_threads(), flush=True))  # runs after ours
import torch, torch.distributed as dist
import hyper_parallel as hp
mesh = hp.init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
x = hp.distribute_tensor(torch.ones(4, 4), mesh, [hp.Shard(0)])
assert float(x.full_tensor().sum()) == 16.0
dist.destroy_process_group()            # as train.py does: torch's references go, the library's stay
print("gloo threads after destroy_process_group:", gloo_threads(), flush=True)
"""


def test_exit_hook_joins_gloo_threads_before_teardown(tmp_path):
    """The mechanism of the fix, deterministically: after ``destroy_process_group`` the library's
    group cache still holds the groups (their gloo threads run on); the exit hook frees them, so no
    gloo thread is left when the interpreter finalizes."""
    import os
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _EXIT_THREADS], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    after_destroy = int(out.split("gloo threads after destroy_process_group:")[1].split()[0])
    assert after_destroy > 0, out  # the groups outlive destroy_process_group (what used to race at exit)
    assert "gloo threads at teardown: 0" in out, out
