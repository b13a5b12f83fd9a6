"""Shared benchmark plumbing: spawn N gloo ranks, time callables, print tables.

Every benchmark times hyper_parallel and torch.distributed.tensor side by side in
the same processes, with ``torch.set_num_threads(1)``, barrier-synchronised
blocks and the median of several repeats. The machine is noisy: compare ratios
within one run, not absolute numbers across runs.
"""
from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _entry(rank, ws, port, fn, args, queue):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ws))
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    try:
        out = fn(*args)
        if rank == 0:
            queue.put(out)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def launch(ws: int, fn, *args):
    """Run ``fn(*args)`` on ``ws`` gloo ranks; return rank 0's result."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_entry, args=(ws, free_port(), fn, args, queue), nprocs=ws, start_method="spawn")
    return queue.get()


def bench(fn, iters: int, repeats: int = 5, warmup: int = None, sync=None) -> float:
    """Median microseconds per call of ``fn`` over ``repeats`` blocks of ``iters`` calls."""
    return bench_interleaved([fn], iters, repeats, sync, warmup)[0]


def bench_interleaved(fns, iters: int, repeats: int = 15, sync=None, warmup: int = None) -> list:
    """Median microseconds per call of each of ``fns``, measured in alternating blocks.

    Each repeat times one block of ``iters`` calls of every function in turn, so
    slow drifts of the machine (other tenants, frequency changes) hit all of them
    alike and their ratios stay meaningful.
    """
    warmup = warmup if warmup is not None else max(5, iters // 10)
    for fn in fns:
        for _ in range(warmup):
            fn()
    res = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if sync:
                sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            if sync:
                sync()
            res[i].append((time.perf_counter() - t0) / iters * 1e6)
    return [statistics.median(r) for r in res]


def table(headers, rows) -> str:
    cols = [[str(h)] + [str(r[i]) for r in rows] for i, h in enumerate(headers)]
    widths = [max(len(c) for c in col) for col in cols]
    line = lambda vals: "| " + " | ".join(str(v).ljust(w) for v, w in zip(vals, widths)) + " |"
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)
