"""fully_shard: hyper_parallel vs torch.distributed.fsdp.fully_shard (FSDP2), same processes, interleaved.

    python benchmarks/bench_fsdp.py [--iters 3] [--repeats 5] [--only 2,4,2x2]

The example Llama (examples/llama/model.py; d=256, 4 layers, 8 heads, vocab 1024, seq 64, 2
sequences per data-parallel rank), ``fully_shard`` on every block and the root by both libraries
(same initial weights), AdamW. Cases: FSDP on 2 and 4 ranks, and FSDP x TP on a (2, 2) mesh (the
blocks parallelized with the same Megatron plan by each library's own TP, then fully_shard on
mesh["dp"]). Each case times a training step (forward, backward, optimizer step) with and without
prefetch (ours: implicit prefetch on / off via empty prefetch lists; torch: its default / explicit
``set_modules_to_forward_prefetch`` + ``set_modules_to_backward_prefetch`` of the neighbouring
block), in alternating blocks. Collectives per step: ours from hyper_parallel.CommDebugMode, torch's
by counting its ``torch.distributed`` calls (FSDP2's; torch TP's functional collectives are not
seen); FSDP bytes = what one rank puts on the wire for all_gather + reduce_scatter
(hyper_parallel.distributed.comm_record.bytes_sent). Persistent memory: bytes of the local
parameter, gradient and optimizer-state shards per rank after a step. Peak memory: CPU tensors have
no allocator statistics, so two extra, untimed steps per library run under the torch profiler with
``profile_memory=True``, which records every storage allocation and free of the CPU allocator (see
``_peak_step_bytes``: the second step is measured); both libraries' tensors, DTensor local tensors included, go through that same
allocator, so they are counted alike.
"""
from __future__ import annotations

import argparse
import copy

from common import bench_interleaved, launch, table

CFG = dict(dim=256, n_layers=4, n_heads=8, vocab_size=1024, seq=64, per_rank_batch=2)


def _tp_plan(lib):
    return {"attention.wq": lib.ColwiseParallel(), "attention.wk": lib.ColwiseParallel(),
            "attention.wv": lib.ColwiseParallel(), "attention.wo": lib.RowwiseParallel(),
            "feed_forward.w1": lib.ColwiseParallel(), "feed_forward.w3": lib.ColwiseParallel(),
            "feed_forward.w2": lib.RowwiseParallel()}


def worker(iters, repeats, case):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh as t_mesh
    from torch.distributed.fsdp import fully_shard as t_fully_shard
    import torch.distributed.tensor.parallel as ttp

    import hyper_parallel as hp
    from hyper_parallel.distributed import comm_record as rec
    from examples.llama.model import ModelArgs, Transformer, loss_fn

    ws, rank = dist.get_world_size(), dist.get_rank()
    tp = 2 if case == "2x2" else 1
    dp = ws // tp
    args = ModelArgs(dim=CFG["dim"], n_layers=CFG["n_layers"], n_heads=CFG["n_heads"], n_kv_heads=CFG["n_heads"],
                     vocab_size=CFG["vocab_size"], multiple_of=64, max_seq_len=CFG["seq"])
    torch.manual_seed(0)
    base = Transformer(args, init_seed=0)
    ours_m, torch_m = copy.deepcopy(base), copy.deepcopy(base)
    if tp > 1:
        mesh = hp.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        tmesh = t_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        for b in ours_m.layers.values():
            hp.parallelize_module(b, mesh["tp"], _tp_plan(hp))
        for b in torch_m.layers.values():
            ttp.parallelize_module(b, tmesh["tp"], _tp_plan(ttp))
        dmesh, tdmesh = mesh["dp"], tmesh["dp"]
    else:
        dmesh = hp.init_device_mesh("cpu", (ws,))
        tdmesh = t_mesh("cpu", (ws,))
    for b in ours_m.layers.values():
        hp.fully_shard(b, mesh=dmesh)
    hp.fully_shard(ours_m, mesh=dmesh)
    for b in torch_m.layers.values():
        t_fully_shard(b, mesh=tdmesh)
    t_fully_shard(torch_m, mesh=tdmesh)
    opt_o = torch.optim.AdamW(ours_m.parameters(), lr=1e-4)
    opt_t = torch.optim.AdamW(torch_m.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    B, S = CFG["per_rank_batch"], CFG["seq"]
    dp_rank = rank // tp
    x = torch.randint(0, args.vocab_size, (B * dp, S + 1), generator=g)[dp_rank * B:(dp_rank + 1) * B]
    tokens, targets = x[:, :-1], x[:, 1:]

    def prefetch(model, on, lib):
        blocks = list(model.layers.values())
        if lib == "ours":
            for m in blocks + [model]:
                if not on:
                    m.set_modules_to_forward_prefetch([])
                    m.set_modules_to_backward_prefetch([])
                else:
                    m._hp_fsdp_state.forward_prefetch = None
                    m._hp_fsdp_state.backward_prefetch = None
        else:
            for i, b in enumerate(blocks):
                b.set_modules_to_forward_prefetch(blocks[i + 1:i + 2] if on else [])
                b.set_modules_to_backward_prefetch(blocks[i - 1:i] if on and i else [])

    def step(model, opt):
        opt.zero_grad(set_to_none=True)
        out = model(tokens)
        if hasattr(out, "full_tensor"):
            out = out.full_tensor()
        loss_fn(out, targets).backward()
        opt.step()

    # ---- collectives per step
    counts = {}
    with hp.CommDebugMode() as comm:
        step(ours_m, opt_o)
    counts["ours"] = (comm.get_comm_counts(), comm.get_bytes())
    tcount, tbytes = {}, {}
    orig = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single", "all_reduce")}
    kinds = {"all_gather_single": rec.ALL_GATHER, "reduce_scatter_single": rec.REDUCE_SCATTER,
             "all_reduce": rec.ALL_REDUCE}

    def wrap(name):
        def f(*a, **k):
            group = k.get("group")
            gsize = dist.get_world_size(group)
            if name == "all_reduce":
                t = a[0] if a else k["tensor"]
            elif name == "reduce_scatter_single":
                t = a[1] if len(a) > 1 else k["input"]
            else:
                t = a[1] if len(a) > 1 else k["input_tensor"]
            kind = kinds[name]
            tcount[kind] = tcount.get(kind, 0) + 1
            tbytes[kind] = tbytes.get(kind, 0) + rec.bytes_sent(kind, t.numel() * t.element_size(), gsize)
            return orig[name](*a, **k)
        return f
    for n in orig:
        setattr(dist, n, wrap(n))
    try:
        step(torch_m, opt_t)
    finally:
        for n, f in orig.items():
            setattr(dist, n, f)
    counts["torch"] = (tcount, tbytes)

    # ---- persistent bytes (params + grads + optimizer states, local shards)
    def persistent(model, opt):
        loc = lambda t: t._local_tensor if isinstance(t, hp.DTensor) else (t.to_local() if hasattr(t, "to_local") else t)
        n = 0
        for p in model.parameters():
            for t in [p, p.grad] + [v for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.dim()]:
                if t is not None:
                    t = loc(t)
                    n += t.numel() * t.element_size()
        return n
    step(ours_m, opt_o)
    step(torch_m, opt_t)
    mem = {"ours": persistent(ours_m, opt_o), "torch": persistent(torch_m, opt_t)}
    # ---- peak bytes during one (untimed) step per library, prefetch off and on (as timed below)
    peak = {}
    for lib, model, opt in (("torch", torch_m, opt_t), ("ours", ours_m, opt_o)):
        peak[lib] = []
        for on in (False, True):
            prefetch(model, on, lib)
            peak[lib].append(_peak_step_bytes(model, opt, step, persistent, dist.barrier))
    # ---- step times, interleaved
    fns = []
    for lib, model, opt in (("torch", torch_m, opt_t), ("ours", ours_m, opt_o)):
        for on in (False, True):
            def fn(lib=lib, model=model, opt=opt, on=on):
                prefetch(model, on, lib)
                step(model, opt)
            fns.append(fn)
    times = bench_interleaved(fns, iters, repeats, sync=dist.barrier, warmup=2)
    return {"times": times, "counts": counts, "mem": mem, "peak": peak}


def _peak_step_bytes(model, opt, step, persistent, barrier):
    """Peak live bytes on this rank during one training step (forward, backward, optimizer step).

    What is counted: the gradients are dropped first (``zero_grad(set_to_none=True)``), so the
    step starts from the parameter shards plus optimizer states; their bytes (``persistent``, now
    without gradients) are the baseline. Two steps then run under ``torch.profiler`` with
    ``profile_memory=True``: the CPU allocator reports every storage allocation (+size) and free
    (-size) with a timestamp, whoever asked for it -- plain tensors, the local tensors of our
    DTensor and of torch's DTensor, all-gather outputs and unsharded parameters, gradients,
    autograd-saved activations, optimizer temporaries, reduce-scatter buffers. Only the second
    step is measured: peak = baseline + the maximum, over the second step's events, of the running
    sum of all events in time order. So whatever a library keeps alive from one step into the
    next (buffers, the first step's gradients until ``zero_grad``) is counted, and the second
    step's frees of storages allocated in the first step are known sizes. Not counted: buffers
    the model held before profiling (rotary tables, inputs: the same for both libraries) and
    memory gloo allocates outside torch storages. A storage allocated before the profiler started
    and freed during the second step is not subtracted (the allocator never saw its size); it
    would have to survive a whole step, and can only overstate the peak, for both libraries alike.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch._C._profiler import _EventType

    marker = 1_234_567  # bytes of a marker allocation that separates the two steps
    opt.zero_grad(set_to_none=True)
    base = persistent(model, opt)
    barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, opt)
        m = torch.empty(marker, dtype=torch.uint8)
        del m
        step(model, opt)
    barrier()
    events = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for c in node.children:
            walk(c)
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    events.sort()
    live, rise, second = 0, 0, False
    for _, nbytes in events:
        if nbytes == -marker and not second:
            second = True
            continue
        if nbytes == marker and not second:
            continue
        live += nbytes
        if second:
            rise = max(rise, live)
    if not second:
        raise RuntimeError("bench_fsdp: the marker allocation between the two profiled steps was not seen")
    return base + rise


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default="2,4,2x2")
    a = ap.parse_args()
    rows = []
    for case in a.only.split(","):
        ws = 4 if case in ("4", "2x2") else 2
        r = launch(ws, worker, a.iters, a.repeats, case)
        t_off, t_on, o_off, o_on = [t / 1e3 for t in r["times"]]
        label = {"2": "FSDP 2 ranks", "4": "FSDP 4 ranks", "2x2": "FSDP x TP (2, 2)"}[case]
        fmt = lambda c: ", ".join(f"{k} {v}" for k, v in sorted(c[0].items()))
        for lib, off, on in (("torch", t_off, t_on), ("ours", o_off, o_on)):
            c = r["counts"][lib]
            fsdp_bytes = c[1].get("all_gather", 0) + c[1].get("reduce_scatter", 0)
            rows.append([label, lib, f"{off:.1f}", f"{on:.1f}", f"{min(off, on) / min(t_off, t_on):.2f}", fmt(c),
                         f"{fsdp_bytes:,}", f"{r['mem'][lib]:,}", " / ".join(f"{b / 2**20:.1f}" for b in r["peak"][lib])])
    print(table(["case", "impl", "step ms (no prefetch)", "step ms (prefetch)", "best vs torch",
                 "collectives per step", "FSDP bytes sent per step", "persistent bytes/rank",
                 "peak MiB/rank in a step (no prefetch / prefetch)"], rows))
    print("torch's counts cover its torch.distributed calls (FSDP2's all_gather/reduce_scatter); its TP "
          "collectives go through functional collectives and are not counted. Ours count everything "
          "(with TP: the Megatron all_reduces). FSDP bytes = all_gather + reduce_scatter bytes one rank sends. "
          "Peak = parameter shards + optimizer states + the highest rise of live CPU-allocator bytes during "
          "the second of two untimed steps (torch profiler, profile_memory=True), rank 0, prefetch off / on as in the timings.")


if __name__ == "__main__":
    main()
