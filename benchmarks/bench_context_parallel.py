"""Context-parallel attention: ring / Ulysses / hybrid on 2 and 4 ranks vs one process on the whole sequence.

    python benchmarks/bench_context_parallel.py [--seq 1024] [--heads 4] [--head-dim 32] [--iters 2] [--repeats 5]

Causal attention forward + backward of one ``[1, heads, seq, head_dim]`` float32 sequence. Every case
times, in the same processes and in alternating blocks (``common.bench_interleaved``):

* ``single``: one process on the whole sequence, ``F.scaled_dot_product_attention`` (torch's CPU kernel)
  and our block kernel on one rank (``ours@1``: the same explicit math the ring runs per block); every
  rank runs it at once, so the cores are shared as in the parallel cases;
* ring (``p2p`` rotation, overlapped; and ``allgather``) with and without load balancing, Ulysses,
  and hybrid (2 x 2) on 4 ranks.

Reported per case: time per forward+backward (max over ranks), the ratio to ``ours@1 / cp + comm``
(``comm`` = the same ring exchanges timed alone, without compute), the per-rank causal work spread of
the schedule (``(max - min) / mean`` of the score entries each rank computes: deterministic), the
measured per-rank compute time spread (same formula on the block-compute seconds, least of
``--repeats`` runs), and the overlap achieved: ``1 - exposed wait / comm`` (exposed wait = the
time the busiest-waiting rank spent in ``wait()`` on its exchanges, which also absorbs peers'
compute skew).
torch's ``context_parallel`` is not run: in torch 2.13 it has handlers only for the CUDA flash,
memory-efficient and cuDNN SDPA kernels, so it cannot run on CPU (gloo).
"""
from __future__ import annotations

import argparse

from common import bench_interleaved, launch, table


def worker(seq, heads, hd, iters, repeats):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import hyper_parallel as hp
    from hyper_parallel.context_parallel import CausalMask, context_parallel_attention, cp_shard
    from hyper_parallel.context_parallel.api import RingPlan, _schedule
    from hyper_parallel.context_parallel.masks import ring_schedule, schedule_work
    from hyper_parallel.context_parallel.plan import shard_layout
    from hyper_parallel.context_parallel import torch_mechanics as impl
    ws, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, heads, seq, hd, generator=g) for _ in range(3)]
    sync = dist.barrier

    def fb(fn, xs):
        xs = [x.detach().requires_grad_() for x in xs]
        fn(*xs).sum().backward()

    plan1 = RingPlan(None, _schedule((((0, seq),),), 0, CausalMask()), [seq], CausalMask().spec(), hd ** -0.5, "p2p")
    singles = bench_interleaved([lambda: fb(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), full),
                                 lambda: fb(lambda q, k, v: impl.ring_attention(q, k, v, plan1), full)],
                                iters, repeats, sync)
    meshes = {"1d": hp.init_device_mesh("cpu", (ws,))}
    cases = [("ring p2p", "ring", "1d", True, "p2p"), ("ring p2p", "ring", "1d", False, "p2p"),
             ("ring allgather", "ring", "1d", True, "allgather"), ("ulysses", "ulysses", "1d", True, "p2p")]
    if ws == 4:
        meshes["2d"] = hp.init_device_mesh("cpu", (2, 2))
        cases.append(("hybrid 2x2", "hybrid", "2d", True, "p2p"))
    rows = []
    for name, method, mk, lb, rot in cases:
        mesh = meshes[mk]
        shards = cp_shard(mesh, full, [2, 2, 2], load_balance=lb)
        run = lambda: fb(lambda q, k, v: context_parallel_attention(q, k, v, mesh, method=method, is_causal=True,
                                                                    load_balance=lb, rotate=rot), shards)
        t = bench_interleaved([run], iters, repeats, sync)[0]
        # block compute and exposed waits of one forward+backward
        stats = {"compute_s": float("inf"), "wait_s": float("inf")}
        for _ in range(repeats):                 # the least of several runs (the machine is noisy)
            one = {}
            impl.set_stats(one)
            sync()
            run()
            impl.set_stats(None)
            for key in stats:
                stats[key] = min(stats[key], one.get(key, 0.0))
        # the same exchanges alone: K/V sends forward, (R-1) + R in backward
        comm_us = 0.0
        if method == "ring":
            k, v = shards[1], shards[2]
            kv = torch.cat([k.reshape(-1), v.reshape(-1)])
            grp = mesh.get_comm_group(0)

            def exchanges():
                from hyper_parallel.context_parallel.ring import _Exchange, _AllGather
                if rot == "p2p":
                    for _ in range(3 * ws - 2):
                        ex = _Exchange(kv, kv.numel(), grp)
                        ex.wait()
                else:
                    for _ in range(2):
                        _AllGather(kv, [kv.numel()] * ws, grp).wait()
                    from hyper_parallel.distributed import collectives as C
                    C.reduce_scatter(torch.cat([kv] * ws), 0, grp, [kv.numel()] * ws)
            comm_us = bench_interleaved([exchanges], iters, repeats, sync)[0]
        comp = torch.tensor([stats.get("compute_s", 0.0), stats.get("wait_s", 0.0), t])
        allc = [torch.zeros(3) for _ in range(ws)]
        dist.all_gather(allc, comp)
        cs = [float(c[0]) for c in allc]
        waits = [float(c[1]) * 1e6 for c in allc]
        tmax = max(float(c[2]) for c in allc)
        spread = (max(cs) - min(cs)) / (sum(cs) / ws) if sum(cs) else 0.0
        target = singles[1] / ws + comm_us
        overlap = (1 - max(waits) / comm_us) if comm_us else float("nan")
        lay = shard_layout(seq, ws, lb)
        if method == "ring":
            work = [schedule_work(ring_schedule(lay, r, CausalMask())) for r in range(ws)]
            wspread = f"{100 * (max(work) - min(work)) / (sum(work) / ws):.0f}%"
        else:
            wspread = "-"
        rows.append([f"{name}{'' if lb else ' (no LB)'}", ws, f"{tmax / 1e3:.1f}", f"{tmax / target:.2f}", wspread,
                     f"{comm_us / 1e3:.1f}" if comm_us else "-", f"{100 * spread:.0f}%",
                     f"{100 * overlap:.0f}%" if comm_us else "-"])
    return singles, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ranks", default="2,4")
    a = ap.parse_args()
    print(f"causal attention fwd+bwd, [1, {a.heads}, {a.seq}, {a.head_dim}] float32, gloo, 1 thread per rank")
    print("torch.distributed.tensor.experimental.context_parallel: not run (torch 2.13 handles only the CUDA "
          "flash / efficient / cuDNN SDPA kernels; it cannot run on CPU)")
    rows = []
    for ws in [int(x) for x in a.ranks.split(",")]:
        singles, r = launch(ws, worker, a.seq, a.heads, a.head_dim, a.iters, a.repeats)
        print(f"\n{ws} ranks: single process on the whole sequence: torch SDPA {singles[0] / 1e3:.1f} ms, "
              f"ours@1 {singles[1] / 1e3:.1f} ms")
        rows += r
    print()
    print(table(["case", "cp", "ms (max rank)", "vs ours@1/cp + comm", "work spread", "comm alone ms",
                 "compute spread",
                 "overlap"], rows))


if __name__ == "__main__":
    main()
