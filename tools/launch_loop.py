"""Run a torchrun launch N times (optionally under CPU load) and count the ones that abort at exit.

    python tools/launch_loop.py --n 50 --hog 4                      # tools/gloo_exit_repro.py, 4 processes
    python tools/launch_loop.py --n 50 --hog 4 --destroy            # the same, with destroy_process_group
    python tools/launch_loop.py --n 20 --hog 4 -- examples/llama/train.py --tp 2 --config tiny --steps 2 --no-compare

Every launch is ``python -m torch.distributed.run --standalone --nproc-per-node P SCRIPT ARGS``;
a launch *aborts* when its output has gloo's teardown signature ("terminate called without an
active exception") or a process died of SIGABRT; any other non-zero exit is counted as a failure.
``--hog K`` keeps K busy-looping processes alive during the loop (the "under load" of the issue).
``--cores DIR`` runs each launch with an unlimited core size in DIR (for gdb). Exit status 1 if any
launch aborted or failed. Prints one line per launch and a summary line:

    launch_loop: N launches, A aborts, F other failures (P processes each, hog K, load L)
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIGNATURE = "terminate called without an active exception"


def _hog():
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def launch(script, args, nproc, timeout, cwd, env, cores=False):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(script), *args]
    pre = (lambda: resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))) \
        if cores else None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env,
                              preexec_fn=pre)
    except subprocess.TimeoutExpired as e:
        return "timeout", f"{e.stdout}\n{e.stderr}"
    out = proc.stdout + proc.stderr
    if SIGNATURE in out or "Signal 6 (SIGABRT)" in out or "exitcode  : -6" in out:
        return "abort", out
    return ("ok" if proc.returncode == 0 else "fail"), out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=50, help="launches")
    p.add_argument("--nproc", type=int, default=4, help="processes per launch")
    p.add_argument("--hog", type=int, default=0, help="busy-looping processes alive during the loop")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    p.add_argument("--destroy", action="store_true", help="pass --destroy to the default repro script")
    p.add_argument("--cores", default=None, help="directory for core files (unlimited core size)")
    p.add_argument("--show", type=int, default=1, help="print the output tail of the first K aborts/failures")
    p.add_argument("script", nargs="?", default=str(ROOT / "tools" / "gloo_exit_repro.py"))
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    args = [x for x in a.args if x != "--"]
    script = Path(a.script).resolve()  # launches run in a scratch directory (core files land there)
    if a.destroy:
        args.append("--destroy")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cwd = a.cores or tempfile.mkdtemp(prefix="launch_loop_")
    os.makedirs(cwd, exist_ok=True)
    hogs = [_hog() for _ in range(a.hog)]
    counts = {"ok": 0, "abort": 0, "fail": 0, "timeout": 0}
    shown = 0
    loads = []
    try:
        for i in range(a.n):
            t0 = time.perf_counter()
            kind, out = launch(script, args, a.nproc, a.timeout, cwd, env, cores=a.cores is not None)
            counts[kind] += 1
            loads.append(os.getloadavg()[0])
            print(f"launch {i + 1}/{a.n}: {kind} ({time.perf_counter() - t0:.1f}s, load {loads[-1]:.1f})", flush=True)
            if kind != "ok" and shown < a.show:
                shown += 1
                print("\n".join(out.splitlines()[-80:]), flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        if a.cores is None:
            shutil.rmtree(cwd, ignore_errors=True)
    other = counts["fail"] + counts["timeout"]
    print(f"launch_loop: {a.n} launches, {counts['abort']} aborts, {other} other failures "
          f"({a.nproc} processes each, hog {a.hog}, mean load {sum(loads) / max(len(loads), 1):.1f})", flush=True)
    return 1 if counts["abort"] or other else 0


if __name__ == "__main__":
    sys.exit(main())
