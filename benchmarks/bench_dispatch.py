"""Per-op overhead: plain torch vs torch.distributed.tensor vs hyper_parallel, same run.

    python benchmarks/bench_dispatch.py [--iters 2000]

Ops on 64x64 local shards (no communication in any case): add, matmul (S0 @ R),
relu, sum(dim=-1), softmax(dim=-1), view and transpose (attention-style reshapes),
two keyword calls (mean(-1, keepdim=True), F.softmax(x, dim=-1)), and a Linear(64, 64)
forward+backward. On 1
rank (mesh (1,), Shard(0)) and 2 ranks (mesh (2,), Shard(0): global 128x64).
overhead ratio = (ours - plain) / (torch - plain); the target is <= 0.3. Times are
medians of 15 blocks, the three variants timed in alternating blocks.
Also counts DTensor dispatches during backward (ours: __torch_function__ calls;
torch: __torch_dispatch__ calls on DTensors).
"""
from __future__ import annotations

import argparse

from common import bench_interleaved, launch, table


def worker(iters):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh as t_mesh
    from torch.distributed.tensor import DTensor as TDT, Replicate as TR, Shard as TS, distribute_tensor as t_dist

    import hyper_parallel as hp
    from hyper_parallel import Replicate, Shard
    from hyper_parallel.dispatch import dispatcher as _op_dispatch
    ws = dist.get_world_size()
    mesh, tmesh = hp.init_device_mesh("cpu", (ws,)), t_mesh("cpu", (ws,))
    torch.manual_seed(0)
    a, b = torch.randn(64 * ws, 64), torch.randn(64, 64)
    da, db = hp.distribute_tensor(a, mesh, [Shard(0)]), hp.distribute_tensor(b, mesh, [Replicate()])
    ta, tb = t_dist(a, tmesh, [TS(0)]), t_dist(b, tmesh, [TR()])
    la, lb = da.to_local().clone(), b.clone()
    ops = {
        "add": (lambda x, y: x + x),
        "matmul": (lambda x, y: x @ y),
        "relu": (lambda x, y: torch.relu(x)),
        "sum(-1)": (lambda x, y: x.sum(-1)),
        "softmax(-1)": (lambda x, y: torch.softmax(x, -1)),
        "view(-1, 8, 8)": (lambda x, y: x.view(-1, 8, 8)),
        "transpose(0, 1)": (lambda x, y: x.transpose(0, 1)),
        "mean(-1, keepdim=True)": (lambda x, y: x.mean(-1, keepdim=True)),
        "F.softmax(dim=-1)": (lambda x, y: F.softmax(x, dim=-1)),
    }
    rows = []
    for name, f in ops.items():
        torch.testing.assert_close(f(da, db).to_local(), f(la, lb))
        p, t, o = bench_interleaved([lambda: f(la, lb), lambda: f(ta, tb), lambda: f(da, db)], iters,
                                    sync=dist.barrier)
        rows.append((name, ws, f"{p:.1f}", f"{t:.1f}", f"{o:.1f}", f"{(o - p) / (t - p):.2f}"))
    # Linear forward + backward: weight column-sharded, input replicated
    w = torch.randn(64 * ws, 64)
    dw = hp.distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    lw = dw.to_local().detach().clone().requires_grad_()
    tw = t_dist(w, tmesh, [TS(0)]).requires_grad_()
    x = torch.randn(64, 64)
    dx, tx = hp.distribute_tensor(x, mesh, [Replicate()]), t_dist(x, tmesh, [TR()])

    def step(xx, ww):
        F.linear(xx, ww).sum().backward()
    p, t, o = bench_interleaved([lambda: step(x, lw), lambda: step(tx, tw), lambda: step(dx, dw)], iters // 4,
                                sync=dist.barrier)
    rows.append(("Linear fwd+bwd", ws, f"{p:.1f}", f"{t:.1f}", f"{o:.1f}", f"{(o - p) / (t - p):.2f}"))

    # DTensor dispatches during backward (the backward() call itself is not counted)
    from torch.utils._python_dispatch import TorchDispatchMode
    counts = {"ours": 0, "torch": 0}
    orig_tf = hp.DTensor.__torch_function__.__func__

    def counting_tf(cls, func, types, args=(), kwargs=None):
        if func is not torch.Tensor.backward:
            counts["ours"] += 1
        return orig_tf(cls, func, types, args, kwargs)

    class CountDTensorOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, TDT) for t in types):
                counts["torch"] += 1
            return func(*args, **(kwargs or {}))
    loss = F.gelu(F.linear(dx, dw)).sum()
    hp.DTensor.__torch_function__ = classmethod(counting_tf)
    try:
        loss.backward()
    finally:
        hp.DTensor.__torch_function__ = classmethod(orig_tf)
    tloss = F.gelu(F.linear(tx, tw)).sum()
    with CountDTensorOps():
        tloss.backward()
    return rows, counts, _op_dispatch.cache_stats()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    rows, notes = [], []
    for ws in (1, 2):
        r, counts, stats = launch(ws, worker, a.iters)
        rows += r
        notes.append(f"ws={ws}: DTensor dispatches during backward of gelu(linear(x, w)).sum(): "
                     f"ours {counts['ours']}, torch {counts['torch']}")
    print("per-op time in microseconds (median of 15 interleaved blocks)")
    print(table(["op", "ws", "plain us", "torch DTensor us", "ours us", "overhead ratio"], rows))
    print("\n".join(notes))


if __name__ == "__main__":
    main()
