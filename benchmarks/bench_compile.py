"""torch.compile on tensor-parallel modules: hyper_parallel vs torch.distributed.tensor, eager vs compiled.

    python benchmarks/bench_compile.py [--iters 20] [--ranks 1 2] [--backend inductor]

Cases (the issue-14 measurements): the MLP Linear 128->512 Colwise, GELU, Linear
512->128 Rowwise, LayerNorm, batch 16; the example Llama block (d=256, 8 heads,
seq 128, batch 4) under the torchtitan TP plan and TP+SP plan. Each is timed as a
training step (forward + backward of ``out.pow(2).mean()``, no optimizer) on 1
and 2 gloo ranks with 1 thread per rank, for: torch's DTensor eager and
compiled, ours eager and compiled, and the floor - the same module on plain
local tensors in one process, compiled (full size: on 2 ranks each rank of the
TP runs does half the flops plus the collectives). Compile time is the first
compiled step (trace + compile + run), per library.

Eager times are measured before anything is compiled (compiling switches our
DTensor to compile mode, which removes its eager-only Python fast methods), all
variants interleaved in alternating blocks (see common.bench_interleaved).
"""
from __future__ import annotations

import argparse
import copy
import time

from tp_plans import TorchLib, llama_block_plan
from common import bench_interleaved, launch, table


def _mlp_plan(lib):
    return {"w1": lib.ColwiseParallel(), "w2": lib.RowwiseParallel()}


def worker(iters, backend):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh as t_mesh

    import hyper_parallel as hp
    from examples.llama.model import ModelArgs, RMSNorm, TransformerBlock, precompute_rope
    hp.SequenceParallel.register_module_type(RMSNorm)
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh, tmesh = hp.init_device_mesh("cpu", (ws,)), t_mesh("cpu", (ws,))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2, self.ln = nn.Linear(128, 512), nn.Linear(512, 128), nn.LayerNorm(128)

        def forward(self, x):
            return self.ln(self.w2(F.gelu(self.w1(x))))

    args = ModelArgs(dim=256, n_layers=1, n_heads=8, n_kv_heads=8, vocab_size=256, multiple_of=64, max_seq_len=128)
    cos, sin = precompute_rope(args.head_dim, 128, args.rope_theta)
    torch.manual_seed(0)
    cases = [("MLP", MLP(), lambda lib: _mlp_plan(lib), torch.randn(16, 128), False),
             ("block TP", TransformerBlock(args), lambda lib: llama_block_plan(lib, False), torch.randn(4, 128, 256), False),
             ("block TP+SP", TransformerBlock(args), lambda lib: llama_block_plan(lib, True), torch.randn(4, 128, 256), True)]
    rows = []
    for name, ref, plan, x, sp in cases:
        extra = (cos, sin) if "block" in name else ()
        inp = x.chunk(ws, dim=1)[rank].contiguous() if sp else x
        mods = {"plain": copy.deepcopy(ref)}
        for lib_name, lib, m in (("torch", TorchLib, tmesh), ("ours", hp, mesh)):
            mods[lib_name] = lib.parallelize_module(copy.deepcopy(ref), m, plan(lib))
        inputs = {"plain": x, "torch": inp, "ours": inp}

        def step(f, key):
            out = f(inputs[key], *extra)
            out.pow(2).mean().backward()

        eager = bench_interleaved([lambda k=k: step(mods[k], k) for k in ("torch", "ours")], iters, repeats=7,
                                  sync=dist.barrier)
        compiled, ctime = {}, {}
        for k in ("plain", "torch", "ours"):
            compiled[k] = torch.compile(mods[k], backend=backend, fullgraph=True, dynamic=False)
            dist.barrier()
            t0 = time.perf_counter()
            step(compiled[k], k)
            ctime[k] = time.perf_counter() - t0
        comp = bench_interleaved([lambda k=k: step(compiled[k], k) for k in ("plain", "torch", "ours")], iters,
                                 repeats=7, sync=dist.barrier)
        from torch._dynamo.utils import counters
        breaks = sum(counters["graph_break"].values())
        t_eager = dict(zip(("torch", "ours"), eager))
        t_comp = dict(zip(("plain", "torch", "ours"), comp))
        for k in ("torch", "ours"):
            rows.append((ws, name, k, f"{t_eager[k] / 1e3:.2f}", f"{t_comp[k] / 1e3:.2f}",
                         f"{t_eager[k] / t_comp[k]:.2f}x", f"{t_comp[k] / t_comp['torch']:.2f}",
                         f"{t_comp[k] / t_comp['plain']:.2f}", f"{ctime[k]:.1f}", breaks if k == "ours" else ""))
        rows.append((ws, name, "plain (1 proc)", "", f"{t_comp['plain'] / 1e3:.2f}", "", "", "1.00",
                     f"{ctime['plain']:.1f}", ""))
        from hyper_parallel.compile import compile_mode
        compile_mode.restore_eager_fast_paths()  # also resets dynamo for the next case
        counters.clear()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--backend", default="inductor")
    a = ap.parse_args()
    rows = []
    for ws in a.ranks:
        rows += launch(ws, worker, a.iters, a.backend)
    print(f"gloo, 1 thread per rank, backend={a.backend}; ms per training step (forward + backward), median of 7 "
          "interleaved blocks")
    print(table(["ranks", "case", "impl", "eager ms", "compiled ms", "compile speedup", "compiled vs torch",
                 "compiled vs floor", "compile s", "graph breaks"], rows))


if __name__ == "__main__":
    main()
