"""Tensor-parallel transformer blocks: hyper_parallel vs torch.distributed.tensor.parallel, same run.

    python benchmarks/bench_tp.py [--iters 5]

Llama blocks from examples/llama/model.py (RMSNorm, rotary, attention, SwiGLU),
configs (A) d=256, 8 heads, 2 layers, seq 128, batch 4 and (B) d=1024, 8 heads,
1 layer, seq 256, batch 4, on 2 ranks, parallelized with the same torchtitan
plan by both libraries (with and without sequence parallelism). Times forward
(no grad) and a training step (forward + backward of out.pow(2).mean(), no
optimizer), plus plain single-process time with 1 thread. Prints collective counts
per step and the max difference of the outputs from the single-process model.
"""
from __future__ import annotations

import argparse
import copy

from tp_plans import TorchLib, llama_block_plan
from common import bench, bench_interleaved, launch, table

CONFIGS = {"A": dict(dim=256, n_layers=2, seq=128, batch=4), "B": dict(dim=1024, n_layers=1, seq=256, batch=4)}


def worker(iters, cfg_name):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh as t_mesh
    from torch.distributed.tensor.debug import CommDebugMode as TComm

    import hyper_parallel as hp
    from examples.llama.model import ModelArgs, RMSNorm, TransformerBlock, precompute_rope
    hp.SequenceParallel.register_module_type(RMSNorm)  # the example's norm is per token: SP may shard it
    c = CONFIGS[cfg_name]
    ws, rank = dist.get_world_size(), dist.get_rank()
    args = ModelArgs(dim=c["dim"], n_layers=c["n_layers"], n_heads=8, n_kv_heads=8, vocab_size=256,
                     multiple_of=64, max_seq_len=c["seq"])
    torch.manual_seed(0)
    ref = nn.ModuleList([TransformerBlock(args) for _ in range(args.n_layers)])
    cos, sin = precompute_rope(args.head_dim, c["seq"], args.rope_theta)
    x = torch.randn(c["batch"], c["seq"], c["dim"])

    def run(blocks, inp):
        for b in blocks:
            inp = b(inp, cos, sin)
        return inp
    with torch.no_grad():
        y_ref = run(ref, x)
    # plain single process, 1 thread
    t_plain_f = bench(lambda: torch.no_grad()(run)(ref, x), iters)
    t_plain_s = bench(lambda: run(ref, x).pow(2).mean().backward(), iters)
    rows = []
    mesh, tmesh = hp.init_device_mesh("cpu", (ws,)), t_mesh("cpu", (ws,))
    for sp in (False, True):
        res, built = {}, {}
        for name, lib, m, Comm in (("torch", TorchLib, tmesh, TComm), ("ours", hp, mesh, hp.CommDebugMode)):
            blocks = copy.deepcopy(ref)
            for b in blocks:
                lib.parallelize_module(b, m, llama_block_plan(lib, sp))
            inp = x.chunk(ws, dim=1)[rank].contiguous() if sp else x
            with torch.no_grad():
                out = run(blocks, inp)
            full = torch.cat([t for t in _gather(out, ws)], dim=1) if sp else out
            built[name] = (blocks, inp, Comm, (full - y_ref).abs().max().item())
        # torch and ours timed in alternating blocks, so drifts of the machine hit both alike
        fns = []
        for name in ("torch", "ours"):
            blocks, inp = built[name][:2]
            fns.append(lambda blocks=blocks, inp=inp: torch.no_grad()(run)(blocks, inp))
            fns.append(lambda blocks=blocks, inp=inp: run(blocks, inp).pow(2).mean().backward())
        t_tf, t_ts, o_tf, o_ts = bench_interleaved(fns, iters, repeats=7, sync=dist.barrier)
        times = {"torch": (t_tf, t_ts), "ours": (o_tf, o_ts)}
        for name in ("torch", "ours"):  # collectives of one step, counted after timing (torch's mode leaves hooks)
            blocks, inp, Comm, err = built[name]
            with Comm() as comm:
                run(blocks, inp).pow(2).mean().backward()
            counts = {str(getattr(k, "__name__", k)).replace("_into_tensor", "").replace("_tensor", ""): v
                      for k, v in comm.get_comm_counts().items()}
            res[name] = (times[name][0] / 1e3, times[name][1] / 1e3, counts, err)
        for name in ("torch", "ours"):
            tf, ts, counts, err = res[name]
            rows.append((cfg_name, "TP+SP" if sp else "TP", name, f"{tf:.1f}", f"{ts:.1f}",
                         f"{ts / res['torch'][1]:.2f}", f"{err:.1e}",
                         ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))))
    rows.append((cfg_name, "1 process", "plain", f"{t_plain_f / 1e3:.1f}", f"{t_plain_s / 1e3:.1f}", "", "", ""))
    return rows


def _gather(t, ws):
    import torch
    import torch.distributed as dist
    out = [torch.empty_like(t) for _ in range(ws)]
    dist.all_gather(out, t.contiguous())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--configs", nargs="+", default=["A", "B"])
    a = ap.parse_args()
    rows = []
    for cfg in a.configs:
        rows += launch(2, worker, a.iters, cfg)
    print("2 ranks, gloo; ms per call (median of 7 blocks, torch and ours interleaved; 1 process: median of 5);"
          " step = forward + backward")
    print(table(["cfg", "mode", "impl", "fwd ms", "step ms", "step vs torch", "max |out - 1proc|",
                 "collectives per step"], rows))


if __name__ == "__main__":
    main()
