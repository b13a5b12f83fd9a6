"""Pipeline parallelism: hyper_parallel's stages (with our TP) vs torch.distributed.pipelining (with torch's
DTensor TP), same model, same microbatches, same processes.

    python benchmarks/bench_pipeline.py                   # 2 ranks (pp 2) and 4 ranks (pp 2 x tp 2)
    python benchmarks/bench_pipeline.py --worlds 2 --iters 3 --dim 128 --layers 8

For each schedule (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble) and library, on every rank:

* step time: median over ``--iters`` training steps (forward + backward of all microbatches, no
  optimizer), torch and ours timed in alternating blocks; the ratio is ours / torch;
* bubble: measured as ``1 - busy / step`` per rank, where ``busy`` is the time inside the stages'
  ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` and the schedule's
  loss (the same wrappers on torch's stage and ours: examples/llama/pipeline.BubbleMeter), shown as
  the mean over the ranks next to the schedule's formula: ``(p-1)/(m+p-1)`` for GPipe and 1F1B,
  ``(p-1)/(v*m+p-1)`` for Interleaved1F1B with ``v`` stages per rank, about 0 for ZBV (when the
  forward, input-gradient and weight-gradient passes take equal time);
* p2p bytes per step: the bytes of every send the stages post (forward activations and backward
  gradients, summed over the ranks), next to the activations' bytes (2 x M x cross-rank boundaries
  x one microbatch's boundary tensor on every tp rank), and the metadata messages sent after the
  first step (should be 0);
* peak activation memory: the largest number of bytes saved for backward (autograd's saved
  tensors, parameters excluded, each storage counted once) alive at once on a rank during a step,
  the max over the ranks, above what was alive when the step began; a count of live activations, not an
  allocator total. "left over" is what was still alive (saved for a backward) when the step began.

The machine is a shared 2-core CPU: absolute times are noisy, ratios within one run are what to read.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import launch, table  # noqa: E402

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")


class _Probe:
    """p2p bytes, metadata messages and live saved-activation bytes of one rank's stages."""

    def __init__(self, stages, param_ptrs):
        import torch
        self.torch = torch
        self.bytes = 0
        self.meta = 0
        self.live = {}
        self.cur = 0
        self.peak = 0
        self.params = param_ptrs
        for st in stages:
            for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
                self._wrap_send(st, name)
            fn = st._send_meta

            def meta(*a, _fn=fn, **k):
                self.meta += 1
                return _fn(*a, **k)
            st._send_meta = meta

    def _wrap_send(self, st, name):
        fn = getattr(st, name)

        def counted(*a, **k):
            ops = fn(*a, **k)
            for op in ops:
                if op.op is self.torch.distributed.isend:
                    self.bytes += op.tensor.numel() * op.tensor.element_size()
            return ops
        setattr(st, name, counted)

    def hooks(self):
        torch = self.torch
        probe = self

        class Held:
            __slots__ = ("t", "key")

            def __init__(self, t, key):
                self.t, self.key = t, key

            def __del__(self):
                if self.key is not None:
                    ent = probe.live[self.key]
                    ent[0] -= 1
                    if ent[0] == 0:
                        probe.cur -= ent[1]
                        del probe.live[self.key]

        def local(t):
            inner = getattr(t, "_local_tensor", None)
            return inner if isinstance(inner, torch.Tensor) else t

        def pack(t):
            loc = local(t)
            try:
                ptr = loc.untyped_storage().data_ptr()
            except Exception:
                return Held(t, None)
            if ptr in probe.params or ptr == 0:
                return Held(t, None)
            ent = probe.live.get(ptr)
            if ent is None:
                ent = probe.live[ptr] = [0, loc.untyped_storage().nbytes()]
                probe.cur += ent[1]
                probe.peak = max(probe.peak, probe.cur)
            ent[0] += 1
            return Held(t, ptr)

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t)


def _torch_tp(stage, tmesh):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from benchmarks.tp_plans import TorchLib, llama_block_plan
    ends = {}
    if stage.tok_embeddings is not None:
        ends["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if stage.output is not None:
        ends["output"] = ColwiseParallel(output_layouts=Replicate())
    if ends:
        parallelize_module(stage, tmesh, ends)
    for blk in stage.layers.values():
        parallelize_module(blk, tmesh, llama_block_plan(TorchLib, False))


def worker(tp, dim, layers, seq, mb, mb_factor, iters, schedules=SCHEDULES):
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as tpp
    from torch.distributed.device_mesh import init_device_mesh as t_mesh

    import hyper_parallel as hp
    from hyper_parallel import pipelining as pp
    from examples.llama.model import ModelArgs, Transformer, loss_fn
    from examples.llama.parallelize import parallelize_llama
    from examples.llama.pipeline import BubbleMeter

    ws, rank = dist.get_world_size(), dist.get_rank()
    npp = ws // tp
    args = ModelArgs(dim=dim, n_layers=layers, n_heads=8, n_kv_heads=8, vocab_size=256, multiple_of=64,
                     max_seq_len=seq)
    base = Transformer(args, init_seed=0)
    mesh = hp.init_device_mesh("cpu", (npp, tp), mesh_dim_names=("pp", "tp"))
    tmesh = t_mesh("cpu", (npp, tp), mesh_dim_names=("pp", "tp"))
    m = mb_factor * npp
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (m * mb, seq), generator=g)
    y = torch.randint(0, 256, (m * mb, seq), generator=g)
    rows = []
    for name in schedules:
        built = {}
        libs = ("torch", "ours")
        for lib in libs:
            parts = pp.split_into_stages(copy.deepcopy(base), mesh["pp"], schedule=name)
            ns = npp * (1 if name in ("GPipe", "1F1B") else 2)
            if lib == "ours":
                for _, mod in parts:
                    parallelize_llama(mod, mesh, sequence_parallel=False, src_data_rank=None)
                stages = [pp.PipelineStage(mod, s, ns, torch.device("cpu"), group=mesh["pp"].get_group())
                          for s, mod in parts]
                cls = pp.get_schedule_class(name)
            else:
                for _, mod in parts:
                    if tp > 1:
                        _torch_tp(mod, tmesh["tp"])
                stages = [tpp.PipelineStage(mod, s, ns, torch.device("cpu"), group=tmesh["pp"].get_group())
                          for s, mod in parts]
                cls = tpp.schedules.get_schedule_class(name)
            sched = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=m, loss_fn=loss_fn)
            ptrs = set()
            for _, mod in parts:
                for p in mod.parameters():
                    loc = getattr(p, "_local_tensor", None)
                    loc = loc if isinstance(loc, torch.Tensor) else (p.to_local() if hasattr(p, "to_local") else p)
                    ptrs.add(loc.untyped_storage().data_ptr())
            first = any(s == 0 for s, _ in parts)
            last = any(s == ns - 1 for s, _ in parts)
            meter = BubbleMeter(stages, sched)
            probe = _Probe(stages, ptrs)
            mods = [mod for _, mod in parts]

            def step(sched=sched, first=first, last=last, mods=mods):
                for mod in mods:
                    mod.zero_grad(set_to_none=True)
                sched.step(*((x,) if first else ()), target=y if last else None, losses=[] if last else None)
            step()  # first step: metadata inference, buffers
            built[lib] = (step, meter, probe, parts)
        times = {"torch": [], "ours": []}
        bub = {"torch": [], "ours": []}
        for _ in range(iters):
            for lib in libs:
                step, meter, probe, _ = built[lib]
                dist.barrier()
                probe.bytes, probe.meta, probe.peak, probe.start = 0, 0, probe.cur, probe.cur
                with probe.hooks():
                    _, dt, b = meter.measure(step)
                times[lib].append(dt)
                bub[lib].append(b)
        for lib in libs:
            _, _, probe, parts = built[lib]
            stats = [statistics.median(times[lib]), statistics.median(bub[lib]), probe.bytes / 1, probe.meta,
                     probe.peak - probe.start, probe.start]
            gathered = [None] * ws
            dist.all_gather_object(gathered, stats)
            if rank == 0:
                t = max(s[0] for s in gathered)
                b = sum(s[1] for s in gathered) / ws
                nbytes = sum(s[2] for s in gathered)
                meta = sum(s[3] for s in gathered)
                peak = max(s[4] for s in gathered)
                left = max(s[5] for s in gathered)
                rows.append([name, lib, t, b, nbytes, meta, (peak, left)])
    if rank != 0:
        return None
    v = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2}
    out = []
    act = mb * seq * dim * 4 * tp  # one microbatch's boundary tensor on every tp rank (fp32)
    for name, lib, t, b, nbytes, meta, peak in rows:
        ref = next(r for r in rows if r[0] == name and r[1] == "torch")
        if t is None:
            out.append((f"pp{npp}xtp{tp}", name, lib, "fails: ZB weight grad on TP DTensor params", "", "", "", "",
                        "", "", "", ""))
            continue
        p, vv = npp, v[name]
        formula = 0.0 if name == "ZBVZeroBubble" else (p - 1) / (vv * m + p - 1)
        ns = p * vv
        rank_of = [s % p if vv == 1 or name != "ZBVZeroBubble" else (s if s < p else 2 * p - 1 - s) for s in range(ns)]
        cross = sum(1 for s in range(ns - 1) if rank_of[s] != rank_of[s + 1])
        out.append((f"pp{p}" + (f"xtp{tp}" if tp > 1 else ""), name, lib, f"{t * 1e3:.0f}", f"{t / ref[2]:.2f}",
                    f"{b:.0%}", f"{formula:.0%}", f"{nbytes / 1e6:.3f}", f"{2 * m * cross * act / 1e6:.3f}",
                    meta, f"{peak[0] / 1e6:.2f}", f"{peak[1] / 1e6:.2f}"))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="2: pp 2; 4: pp 2 x tp 2")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mb", type=int, default=2, help="microbatch size (rows)")
    ap.add_argument("--mb-factor", type=int, default=4, help="microbatches M = factor x pp")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    a = ap.parse_args(argv)
    rows = []
    t0 = time.perf_counter()
    for ws in a.worlds:
        tp = 1 if ws == 2 else 2
        rows += launch(ws, worker, tp, a.dim, a.layers, a.seq, a.mb, a.mb_factor, a.iters, tuple(a.schedules))
    print(f"example Llama dim {a.dim}, {a.layers} layers, seq {a.seq}, microbatch {a.mb} rows, "
          f"M = {a.mb_factor} x pp microbatches, median of {a.iters} steps ({time.perf_counter() - t0:.0f}s)")
    print(table(("layout", "schedule", "lib", "step ms", "x torch", "bubble", "formula", "p2p MB/step",
                 "activations MB", "meta msgs", "peak act MB", "left over MB"), rows))


if __name__ == "__main__":
    main()
