"""Expert parallelism: the MoE layer with EP vs experts replicated vs one process; dispatch/combine; grouped mm.

    python benchmarks/bench_moe.py [--tokens 256] [--dim 128] [--hidden 256] [--experts 8] [--top-k 2]
                                   [--iters 3] [--repeats 5] [--only 2,4]

A MoE layer (softmax top-k router, SwiGLU GroupedExperts through ``moe.grouped_mm``, float32) on
``--tokens`` tokens per rank; one training step = forward + backward + the gradient reductions a
data-parallel job needs (an all_reduce of the replicated parameters' gradients). In the same
processes, alternating blocks:

* **EP**: ``parallelize_module(layer, mesh["ep"], {"experts": ExpertParallel()})``, experts sharded
  1/ep per rank; the router gradient is all_reduced, the expert gradients need nothing;
* **torch EP**: the same layer on torch's own DTensor and functional collectives, expert-parallel as
  torchtitan's token dispatcher does it (``_torch_ep_layer``): the side-by-side baseline;
* **replicated**: the same layer with every expert on every rank (no token exchange) and the expert
  gradients all_reduced with the router's (plain data parallelism);
* **one process**: rank 0 alone runs the whole batch (ep * tokens) on the whole layer, while the
  other ranks wait (time per step of the same global batch).

Also: dispatch + combine alone (identity experts, forward + backward) with the bytes from
``CommDebugMode`` against the formula tokens * top_k * dim * 4 per token all_to_all; the host
syncs per step (``moe.STATS``: device-to-host reads of counts); expert weight bytes per rank; and
``grouped_mm`` against a per-expert loop (the loop fallback, and torch's CPU ``_grouped_mm``
forward for float32) in one process.
"""
from __future__ import annotations

import argparse

from common import bench_interleaved, free_port, launch, table


def _layer_cls():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import hyper_parallel as hp
    from hyper_parallel import moe

    class Experts(nn.Module):
        def __init__(self, E, dim, hidden):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.w1 = nn.Parameter(torch.randn(E, hidden, dim, generator=g) / dim ** 0.5)
            self.w2 = nn.Parameter(torch.randn(E, dim, hidden, generator=g) / hidden ** 0.5)
            self.w3 = nn.Parameter(torch.randn(E, hidden, dim, generator=g) / dim ** 0.5)

        def forward(self, x, num_tokens_per_expert):
            loc = lambda w: w.to_local() if hasattr(w, "to_local") else w   # ours or torch's DTensor
            w1, w2, w3 = loc(self.w1), loc(self.w2), loc(self.w3)
            offs = torch.cumsum(num_tokens_per_expert, 0).to(torch.int32)
            h = F.silu(moe.grouped_mm(x, w1.transpose(-2, -1), offs)) * moe.grouped_mm(x, w3.transpose(-2, -1), offs)
            return moe.grouped_mm(h, w2.transpose(-2, -1), offs)

    class MoE(nn.Module):
        def __init__(self, E, dim, hidden, k):
            super().__init__()
            self.E, self.k = E, k
            self.router = nn.Linear(dim, E, bias=False)
            nn.init.normal_(self.router.weight, generator=torch.Generator().manual_seed(1))
            self.experts = Experts(E, dim, hidden)

        def forward(self, x):
            w, ids = torch.topk(self.router(x).softmax(-1), self.k, dim=-1)
            T = x.shape[0]
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            y = self.experts(x[order // self.k], moe.count_ids(flat, self.E))   # bincount without a host sync
            full = torch.zeros_like(y).index_copy(0, order, y).view(T, self.k, -1)
            return (full * w.unsqueeze(-1)).sum(1)

    return MoE


def _torch_ep_layer(MoE, E, dim, hidden, k):
    """The same layer on torch's own stack, expert-parallel as torchtitan's token dispatcher does it.

    Expert weights are torch DTensors ``Shard(0)`` on a torch mesh; the forward exchanges the counts
    (``all_to_all_single``), reads the splits on the host, moves the tokens with
    ``all_to_all_single_autograd`` (torch's functional collectives), groups the received rows by local
    expert, runs the local experts on ``w.to_local()`` and sends the rows back: the baseline for
    hyper_parallel's ``moe.ExpertParallel`` (same kernel, ``moe.grouped_mm``).
    """
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("ep",))
    group = mesh.get_group()
    layer = MoE(E, dim, hidden, k)
    ex = layer.experts
    for name in ("w1", "w2", "w3"):
        ex.register_parameter(name, nn.Parameter(distribute_tensor(getattr(ex, name).data, mesh, [Shard(0)])))
    inner = ex.forward
    e_loc = E // ws

    def ep_forward(x, num_tokens_per_expert):
        recv = torch.empty_like(num_tokens_per_expert)
        dist.all_to_all_single(recv, num_tokens_per_expert, group=group)
        send_splits = num_tokens_per_expert.view(ws, e_loc).sum(1).tolist()
        recv_splits = recv.view(ws, e_loc).sum(1).tolist()
        rows = all_to_all_single_autograd(x, recv_splits, send_splits, group)
        # received rows: by source rank, then local expert; group them by local expert
        src_exp = torch.arange(ws * e_loc).remainder(e_loc).repeat_interleave(recv)
        order = torch.argsort(src_exp, stable=True)
        out = inner(rows[order], recv.view(ws, e_loc).sum(0))
        back = torch.empty_like(out).index_copy(0, order, out)
        return all_to_all_single_autograd(back, send_splits, recv_splits, group)
    ex.forward = ep_forward
    return layer


def worker(ws, T, dim, hidden, E, k, iters, repeats):
    import torch
    import torch.distributed as dist
    import hyper_parallel as hp
    from hyper_parallel import moe, parallelize_module

    rank = dist.get_rank()
    MoE = _layer_cls()
    mesh = hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("ep",))
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(T, dim, generator=g).requires_grad_(True)   # as inside a model: the input needs a gradient
    ep_layer = parallelize_module(MoE(E, dim, hidden, k), mesh, {"experts": moe.ExpertParallel()})
    rep_layer = MoE(E, dim, hidden, k)
    torch_layer = _torch_ep_layer(MoE, E, dim, hidden, k)
    with torch.no_grad():   # the same output as ours (same weights, same routing)
        assert torch.allclose(torch_layer(x), ep_layer(x), rtol=1e-5, atol=1e-6), "torch EP and EP disagree"

    def allreduce_grads(params):
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            flat = torch.cat([t.reshape(-1) for t in grads])
            dist.all_reduce(flat)

    def ep_step():
        x.grad = None
        ep_layer.zero_grad(set_to_none=True)
        ep_layer(x).sum().backward()
        allreduce_grads([ep_layer.router.weight])

    def rep_step():
        x.grad = None
        rep_layer.zero_grad(set_to_none=True)
        rep_layer(x).sum().backward()
        allreduce_grads(list(rep_layer.parameters()))

    def torch_step():
        x.grad = None
        torch_layer.zero_grad(set_to_none=True)
        torch_layer(x).sum().backward()
        allreduce_grads([torch_layer.router.weight])

    t_ep, t_rep, t_torch = bench_interleaved([ep_step, rep_step, torch_step], iters, repeats, sync=dist.barrier)

    # one process on the whole batch (rank 0 alone)
    t_one = None
    dist.barrier()
    if rank == 0:
        one = MoE(E, dim, hidden, k)
        xa = torch.randn(ws * T, dim, generator=g).requires_grad_(True)

        def one_step():
            one.zero_grad(set_to_none=True)
            one(xa).sum().backward()
        t_one = bench_interleaved([one_step], iters, repeats)[0]
    dist.barrier()

    # collectives, bytes and host syncs of one EP step
    moe.reset_stats()
    with hp.CommDebugMode() as comm:
        ep_step()
    a2a = [e for e in comm.events if e[0] == "all_to_all"]
    syncs = moe.STATS["host_syncs"]

    # dispatch + combine alone (identity experts)
    ids = torch.topk(torch.randn(T, E, generator=g), k, dim=-1).indices
    xr = x.detach().clone().requires_grad_(True)

    def dc():
        routed, counts, h = moe.dispatch(xr, ids, mesh, num_experts=E)
        moe.combine(routed, h).sum().backward()
    t_dc = bench_interleaved([dc], iters * 4, repeats, sync=dist.barrier)[0]
    with hp.CommDebugMode() as comm2:
        routed, counts, h = moe.dispatch(xr, ids, mesh, num_experts=E)
    tok_bytes = comm2.events[1][1]
    local_rows = int(((ids // (E // ws)) == rank).sum())
    buf = torch.tensor([T * k * dim * 4, tok_bytes + local_rows * dim * 4], dtype=torch.float64)
    dist.all_reduce(buf)
    w_ep = sum(p.to_local().numel() * 4 for p in ep_layer.experts.parameters())
    w_rep = sum(p.numel() * 4 for p in rep_layer.experts.parameters())
    return dict(t_ep=t_ep, t_rep=t_rep, t_torch=t_torch, t_one=t_one, n_a2a=len(a2a), a2a_bytes=[e[1] for e in a2a],
                syncs=syncs, t_dc=t_dc, formula=buf[0].item(), moved=buf[1].item(), w_ep=w_ep, w_rep=w_rep)


def grouped_mm_bench(T, dim, hidden, E, iters, repeats):
    import torch
    from hyper_parallel import moe
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, dim, generator=g)
    w = torch.randn(E, dim, hidden, generator=g)
    counts = torch.bincount(torch.randint(0, E, (T,), generator=g), minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)

    def per_expert_loop():   # what a model without grouped_mm writes
        out, lo = [], 0
        for e, n in enumerate(counts.tolist()):
            out.append(x[lo:lo + n] @ w[e])
            lo += n
        return torch.cat(out)

    fns = [lambda: moe.grouped_mm(x, w, offs, impl="loop"), per_expert_loop]
    names = ["grouped_mm (loop fallback)", "per-expert loop (model code)"]
    try:
        torch._grouped_mm(x, w, offs=offs)
        fns.append(lambda: torch._grouped_mm(x, w, offs=offs))
        names.append("torch._grouped_mm (CPU fp32, forward)")
    except RuntimeError:
        pass
    return list(zip(names, bench_interleaved(fns, iters * 10, repeats)))


def gpu_check(iters=20):
    """One CUDA device, NCCL world size 1: grouped_mm native vs loop (values, gradients, time), and the host
    syncs of an EP step and of dispatch+combine counted by torch.cuda's sync debug mode."""
    import os
    import time
    import warnings
    import torch
    import torch.distributed as dist
    import hyper_parallel as hp
    from hyper_parallel import moe, parallelize_module
    from hyper_parallel.moe.grouped_mm import native_supported
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for T, dim, hidden, E in ((4096, 1024, 1024, 8), (16384, 2048, 1408, 16), (32768, 4096, 1536, 64)):
        for dt in (torch.bfloat16, torch.float32):
            x = torch.randn(T, dim, device=dev, dtype=dt, generator=g).requires_grad_(True)
            w = (torch.randn(E, dim, hidden, device=dev, dtype=dt, generator=g) / dim ** 0.5).requires_grad_(True)
            counts = moe.count_ids(torch.randint(0, E, (T,), device=dev, generator=g), E)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            ok = native_supported(x, w)
            res = {}
            for impl in ("native", "loop"):
                try:
                    out = moe.grouped_mm(x, w, offs, impl=impl)
                    gx, gw = torch.autograd.grad(out.float().square().sum(), (x, w))
                    res[impl] = (out.float(), gx.float(), gw.float())

                    def step():
                        o = moe.grouped_mm(x, w, offs, impl=impl)
                        torch.autograd.grad(o.sum(), (x, w))
                    for _ in range(3):
                        step()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        step()
                    torch.cuda.synchronize()
                    res[impl] += ((time.perf_counter() - t0) / iters * 1e3,)
                except RuntimeError as e:
                    res[impl] = (str(e)[:60],)
            def rel(a, b):
                return ((a - b).norm() / b.norm()).item()
            errs = ["-"] * 3
            if len(res["native"]) == 4 and len(res["loop"]) == 4:
                errs = [f"{rel(res['native'][i], res['loop'][i]):.1e}" for i in range(3)]
            tn = f"{res['native'][3]:.2f}" if len(res["native"]) == 4 else res["native"][0]
            tl = f"{res['loop'][3]:.2f}" if len(res["loop"]) == 4 else res["loop"][0]
            rows.append([f"{T}x{dim} @ [{E},{dim},{hidden}]", str(dt).replace("torch.", ""), ok, tn, tl] + errs)
    print(table(["shape", "dtype", "auto picks native", "native fwd+bwd ms", "loop fwd+bwd ms",
                 "rel err out", "rel err dx", "rel err dw"], rows))

    # host syncs of an EP MoE step (EP degree 1 on one GPU: the same code path, collectives skipped)
    MoE = _layer_cls()
    mesh = hp.init_device_mesh("cuda", (1,), mesh_dim_names=("ep",))
    layer = MoE(16, 1024, 1408, 2).to(dev, torch.bfloat16)
    parallelize_module(layer, mesh, {"experts": moe.ExpertParallel()})
    x = torch.randn(8192, 1024, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    layer(x).float().sum().backward()
    torch.cuda.synchronize()
    moe.reset_stats()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(x).float().sum().backward()
        ids = torch.topk(torch.randn(8192, 16, device=dev, generator=g), 2, dim=-1).indices
        routed, counts, h = moe.dispatch(x, ids, mesh, num_experts=16)
        moe.combine(routed, h).float().sum().backward()
    torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0][:80] for w in caught if "synchroniz" in str(w.message)]
    print(f"host syncs seen by torch.cuda sync debug mode in one EP step + one dispatch/combine: {len(syncs)} "
          f"(moe.STATS host_syncs: {moe.STATS['host_syncs']})")
    for s_ in syncs:
        print("   ", s_)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true", help="one CUDA device: grouped_mm native vs loop, host syncs")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default="2,4")
    a = ap.parse_args()
    if a.gpu:
        return gpu_check()
    rows, extra = [], []
    for ws in [int(s) for s in a.only.split(",")]:
        r = launch(ws, worker, ws, a.tokens, a.dim, a.hidden, a.experts, a.top_k, a.iters, a.repeats)
        rows.append([ws, f"{r['t_ep'] / 1e3:.1f}", f"{r['t_torch'] / 1e3:.1f}", f"{r['t_ep'] / r['t_torch']:.2f}",
                     f"{r['t_rep'] / 1e3:.1f}", f"{r['t_one'] / 1e3:.1f}", f"{r['t_ep'] / r['t_rep']:.2f}", f"{r['t_ep'] / r['t_one']:.2f}",
                     f"{r['w_ep'] / 2**20:.2f} / {r['w_rep'] / 2**20:.2f}"])
        extra.append([ws, r["n_a2a"], r["syncs"], f"{r['t_dc'] / 1e3:.2f}", int(r["formula"]), int(r["moved"]),
                      " ".join(str(b) for b in r["a2a_bytes"])])
    print(f"MoE layer: {a.tokens} tokens/rank, dim {a.dim}, hidden {a.hidden}, {a.experts} experts, "
          f"top-{a.top_k}, float32; step = forward + backward + gradient all_reduce (ms, median)")
    print(table(["ranks", "EP", "torch EP", "EP / torch EP", "replicated", "one process (whole batch)",
                 "EP / replicated",
                 "EP / one process", "expert MiB per rank EP / repl."], rows))
    print()
    print(table(["ranks", "all_to_alls per EP step", "host syncs per step", "dispatch+combine fwd+bwd (ms)",
                 "formula T*k*dim*4 (sum over ranks)", "dispatch bytes (sent + kept, sum)",
                 "rank 0 bytes sent per all_to_all"], extra))
    print()
    gm = grouped_mm_bench(a.tokens * 4, a.dim, a.hidden, a.experts, a.iters, a.repeats)
    base = gm[1][1]
    print(f"grouped matmul, one process: {a.tokens * 4} rows, [{a.experts}, {a.dim}, {a.hidden}] weights (us)")
    print(table(["kernel", "us", "vs per-expert loop"], [[n, f"{t:.0f}", f"{t / base:.2f}"] for n, t in gm]))


if __name__ == "__main__":
    main()
