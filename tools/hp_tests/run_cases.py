#!/usr/bin/env python3
"""Run HyperParallel's own torch shard-op cases (OpShardCase registrations) on hyper_parallel.

Two roles in one file:

* ``run_cases.py drive --mode default|strict [--nproc 8] [--only NAME ...]`` (the parent):
  launches ``torchrun`` with the worker role, once; if the job dies or hangs, the case it was
  running is recorded as ``error`` (``crashed/hung``) and a fresh job runs the cases left.
  Results: ``results/<mode>.jsonl`` (one line per case) and ``results/<mode>.log``.
* ``run_cases.py worker`` (under torchrun, every rank): HyperParallel's own flow per case, with
  its framework modules fetched under ``orig/`` (``entry._run_one``: full tensors from the
  case's ``InputSpec``s, the single-process reference, ``distribute_tensor`` with the case's
  placements on ``hyper_parallel.init_device_mesh(mesh_shape)`` (mesh dim names canonicalised
  as HyperParallel's ``suite._bucket_key`` does), the case's fn on the DTensors, gather with its
  ``local_to_global``, compare with its ``CompareSpec``). Cases run one after another in one
  process group; after each case the ranks exchange their outcome (all_gather_object), so a case
  passes only if it passes on every rank.

Statuses: ``pass``; ``fail`` (an AssertionError: a mismatch); ``error`` (any other exception,
first line kept); ``na`` (NPU-only cases, not fetched, listed in NPU_ONLY).
"""
import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
ORIG = HERE / "orig"
RESULTS = HERE / "results"
CASES_PKG = "tests.torch.shard.ops.cases"

# HyperParallel case files that need torch_npu kernels (not applicable on CPU/gloo).
NPU_ONLY = ("case_npu_fusion_attention.py", "case_npu_rms_norm.py", "case_npu_rotary_mul.py")


def _first_line(exc):
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300]


def _where(tb_text):
    """The innermost hyper_parallel frame of a traceback (file:line in function)."""
    hit = ""
    for line in tb_text.splitlines():
        line = line.strip()
        if line.startswith("File ") and "/hyper_parallel/" in line and "/tools/hp_tests/" not in line:
            hit = line.split("/hyper_parallel/", 1)[1].replace('", line ', ":").replace(", in ", " in ")
    return ("hyper_parallel/" + hit) if hit else ""


# ----------------------------------------------------------------------------------- worker
def worker():
    sys.path.insert(0, str(ORIG))
    import torch.distributed as dist  # the worker is test code, not library code

    import tests.torch.shard.ops.framework  # noqa: F401  (registers HyperParallel's torch backends)
    from tests.shard_ops.framework.backend import resolve_backend
    from tests.shard_ops.framework.entry import _run_one
    from tests.shard_ops.framework.registry import load_cases_from_package
    from tests.shard_ops.framework.suite import _bucket_key

    backend = resolve_backend("torch", "cpu")
    backend.maybe_init_dist()
    rank = dist.get_rank()
    todo = json.loads(os.environ["HP_TESTS_TODO"])
    out_path = pathlib.Path(os.environ["HP_TESTS_OUT"])
    progress = pathlib.Path(os.environ["HP_TESTS_PROGRESS"])

    cases = {c.name: c for c in load_cases_from_package(CASES_PKG)}
    for name in todo:
        case = cases[name]
        if rank == 0:
            progress.write_text(name)
        shape, names = _bucket_key(case, (2, 2), ("dp", "tp"))[:2]
        t0 = time.perf_counter()
        status, msg, where = "pass", "", ""
        try:
            mesh = backend.get_or_init_mesh(tuple(shape), tuple(names))
            _run_one(case, backend, mesh)
        except AssertionError as exc:  # HyperParallel's own mismatch reports
            status, msg, where = "fail", _first_line(exc), _where(traceback.format_exc())
        except Exception as exc:  # pylint: disable=broad-except
            status, msg, where = "error", _first_line(exc), _where(traceback.format_exc())
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, (status, msg, where))
        if rank == 0:
            bad = [(r, o) for r, o in enumerate(outcomes) if o[0] != "pass"]
            final = "pass"
            if bad:
                final = "error" if any(o[0] == "error" for _, o in bad) else "fail"
                first = next((r, o) for r, o in bad if o[0] == final)
            rec = {"case": name, "status": final, "mesh": list(shape), "source": case.source_module,
                   "seconds": round(time.perf_counter() - t0, 3)}
            if bad:
                rec.update(error=first[1][1], where=first[1][2], ranks=[r for r, _ in bad])
            with out_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        if status == "error" and not backend.recover_after_failure():
            break
    dist.barrier()
    if rank == 0:
        progress.write_text("")
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------- parent
def _free_port():
    """A port the OS reports free on 127.0.0.1 right now (the job binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def list_cases():
    """Case names, loaded in a plain process (the case modules need no process group)."""
    code = ("import json,sys; sys.path.insert(0, %r);"
            "import tests.torch.shard.ops.framework;"
            "from tests.shard_ops.framework.registry import load_cases_from_package as L;"
            "print(json.dumps([c.name for c in L(%r)]))" % (str(ORIG), CASES_PKG))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env=dict(os.environ))
    return json.loads(out.stdout.strip().splitlines()[-1])


def drive(args):
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{args.mode}.jsonl"
    log = RESULTS / f"{args.mode}.log"
    progress = RESULTS / f".{args.mode}.progress"
    out.write_text("")
    log.write_text("")
    names = args.only or list_cases()
    env = dict(os.environ, OMP_NUM_THREADS="1", HP_TESTS_OUT=str(out), HP_TESTS_PROGRESS=str(progress))
    env["HYPER_PARALLEL_STRICT_LAYOUTS"] = "1" if args.mode == "strict" else "0"
    torchrun = str(pathlib.Path(sys.executable).with_name("torchrun"))
    while True:
        done = {json.loads(l)["case"] for l in out.read_text().splitlines() if l.strip()}
        todo = [n for n in names if n not in done]
        if not todo:
            break
        progress.write_text("")
        env["HP_TESTS_TODO"] = json.dumps(todo)
        cmd = [torchrun, "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               "--nproc_per_node", str(args.nproc), __file__, "worker"]
        with log.open("a") as lf:
            lf.write(f"=== {time.strftime('%T')} {len(todo)} cases, mode {args.mode}\n")
            lf.flush()
            try:
                rc = subprocess.run(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                    timeout=args.job_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        done = {json.loads(l)["case"] for l in out.read_text().splitlines() if l.strip()}
        stuck = progress.read_text().strip() if progress.exists() else ""
        if stuck and stuck not in done:
            with out.open("a") as f:
                f.write(json.dumps({"case": stuck, "status": "error",
                                    "error": f"job crashed/hung in this case (rc={rc})"}) + "\n")
        elif rc != 0 and all(n in done for n in todo) is False:
            nxt = next(n for n in todo if n not in done)
            with out.open("a") as f:
                f.write(json.dumps({"case": nxt, "status": "error",
                                    "error": f"job ended before this case (rc={rc})"}) + "\n")
    print(f"{args.mode}: results in {out}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["drive", "worker"])
    ap.add_argument("--mode", choices=["default", "strict"], default="default")
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--job-timeout", type=int, default=1800)
    args = ap.parse_args()
    if args.role == "worker":
        worker()
    else:
        drive(args)


if __name__ == "__main__":
    main()
