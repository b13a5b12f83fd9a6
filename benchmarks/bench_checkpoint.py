"""Distributed checkpoints: hyper_parallel DTensor vs torch DTensor, both through torch.distributed.checkpoint.

    python benchmarks/bench_checkpoint.py [--ranks 2 4] [--repeats 3] [--dim 384] [--layers 4]

The example Llama (dim 384, 4 layers, 8 heads, 4 kv heads: ~7 M parameters) with AdamW
state (parameters + exp_avg + exp_avg_sq + step) is tensor-parallel over all ranks with
the same Megatron plan by both libraries; the state dicts come from each library's
state-dict helper (``hyper_parallel.checkpoint.get_state_dict`` /
``torch.distributed.checkpoint.state_dict.get_state_dict``). In the same processes and
alternating runs, it measures ``dcp.save`` and ``dcp.load`` (median wall time over
repeats, barrier to barrier), the bytes each rank wrote (its ``.distcp`` file), and
how long ``dcp.async_save`` blocks the caller (the staging copy) before training may
continue. Files go to a temporary directory on local disk.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from common import launch, table


def _torch_plan():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
           "output": ColwiseParallel(output_layouts=Replicate())}
    block = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
             "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
             "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
             "feed_forward.w2": RowwiseParallel()}
    return top, block


def _init_state(model, opt):
    import torch
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(repeats, dim, layers, root):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as tsd
    from torch.distributed.device_mesh import init_device_mesh as t_mesh
    from torch.distributed.tensor.parallel import parallelize_module as t_parallelize

    import hyper_parallel as hp
    from hyper_parallel import checkpoint as hsd
    from examples.llama.model import ModelArgs, build_model
    from examples.llama.parallelize import parallelize_llama

    ws, rank = dist.get_world_size(), dist.get_rank()
    args = ModelArgs(dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, vocab_size=260, multiple_of=64,
                     max_seq_len=128, tie_embeddings=False)
    built = {}
    # ours
    model = build_model(args, 0)
    parallelize_llama(model, hp.init_device_mesh("cpu", (1, ws), mesh_dim_names=("dp", "tp")),
                      sequence_parallel=False, src_data_rank=None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _init_state(model, opt)
    built["ours"] = (model, opt, lambda m, o: hsd.get_state_dict(m, o))
    # torch
    tmodel = build_model(args, 0)
    tm = t_mesh("cpu", (ws,))
    top, block = _torch_plan()
    t_parallelize(tmodel, tm, top)
    for b in tmodel.layers.values():
        t_parallelize(b, tm, block)
    topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-3)
    _init_state(tmodel, topt)
    built["torch"] = (tmodel, topt, lambda m, o: tsd.get_state_dict(m, o))
    nparams = sum(p.numel() for p in model.parameters())

    times = {k: {"save": [], "load": [], "async": [], "async_total": []} for k in built}
    sizes = {}
    for rep in range(repeats + 1):  # the first round warms up (imports, plan caches)
        for name in ("torch", "ours") if rep % 2 else ("ours", "torch"):
            m, o, get = built[name]
            msd, osd = get(m, o)
            state = {"model": msd, "optim": osd}
            path = os.path.join(root, f"{name}-{rep}")
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=path)
            dist.barrier()
            t_save = time.perf_counter() - t0
            msd, osd = get(m, o)
            state = {"model": msd, "optim": osd}
            dist.barrier()
            t0 = time.perf_counter()
            dcp.load(state, checkpoint_id=path)
            dist.barrier()
            t_load = time.perf_counter() - t0
            msd, osd = get(m, o)
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path + "-async")
            t_block = time.perf_counter() - t0
            fut.result()
            dist.barrier()
            t_async_total = time.perf_counter() - t0
            if rep:
                for k, v in (("save", t_save), ("load", t_load), ("async", t_block), ("async_total", t_async_total)):
                    times[name][k].append(v)
            my = os.path.getsize(os.path.join(path, f"__{rank}_0.distcp"))
            sizes_all = [None] * ws
            dist.all_gather_object(sizes_all, my)
            meta = os.path.getsize(os.path.join(path, ".metadata"))
            sizes[name] = (sizes_all, meta)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                shutil.rmtree(path + "-async", ignore_errors=True)
    med = {n: {k: statistics.median(v) * 1e3 for k, v in t.items()} for n, t in times.items()}
    rows = []
    for name in ("torch", "ours"):
        t = med[name]
        per_rank, meta = sizes[name]
        rows.append((ws, name, f"{t['save']:.0f}", f"{t['save'] / med['torch']['save']:.2f}",
                     f"{t['load']:.0f}", f"{t['load'] / med['torch']['load']:.2f}",
                     " / ".join(f"{b / 1e6:.2f}" for b in per_rank), f"{meta / 1e3:.0f}",
                     f"{t['async']:.0f}", f"{t['async_total']:.0f}"))
    return nparams, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    rows = []
    nparams = None
    for ws in a.ranks:
        root = tempfile.mkdtemp(prefix="bench_ckpt_")
        try:
            nparams, r = launch(ws, worker, a.repeats, a.dim, a.layers, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        rows += r
    print(f"example Llama dim {a.dim}, {a.layers} layers: {nparams:,} parameters + AdamW state, TP over all "
          f"ranks, fp32; median of {a.repeats} runs (ms)")
    print(table(["ranks", "DTensor", "save ms", "vs torch", "load ms", "vs torch", "MB written per rank",
                 "metadata kB", "async_save blocks ms", "async_save total ms"], rows))


if __name__ == "__main__":
    main()
