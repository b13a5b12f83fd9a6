"""Redistribution cost: hyper_parallel vs torch.distributed.tensor, same run, same processes.

    python benchmarks/bench_redistribute.py [--iters 10]

(1024, 1024) fp32 on 2 and 4 ranks (1-D mesh) plus two (2, 2) cases; prints ms per
call, the ratio ours/torch, the bytes each rank sends (ours, from CommDebugMode)
and the collectives used. A fresh DTensor is wrapped around the same local data
on every call for both libraries, so neither can reuse a previous result.
"""
from __future__ import annotations

import argparse

from common import bench, launch, table

SHAPE = (1024, 1024)


def _cases(ws):
    from hyper_parallel import Partial as P, Replicate as R, Shard as S
    cases = [("S0->R", [S(0)], [R()]), ("S0->S1", [S(0)], [S(1)]), ("S1->S0", [S(1)], [S(0)]),
             ("P->R", [P()], [R()]), ("P->S0", [P()], [S(0)]), ("R->S0", [R()], [S(0)])]
    if ws == 4:
        cases += [("[S0,S1]->[R,R] (2x2)", [S(0), S(1)], [R(), R()]),
                  ("[S0,R]->[R,S1] (2x2)", [S(0), R()], [R(), S(1)])]
    return cases


def _to_torch(pls):
    from torch.distributed.tensor import Partial, Replicate, Shard
    out = []
    for p in pls:
        if p.is_shard():
            out.append(Shard(p.dim))
        elif p.is_partial():
            out.append(Partial())
        else:
            out.append(Replicate())
    return out


def worker(iters):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh as t_mesh
    from torch.distributed.tensor import DTensor as TDT, distribute_tensor as t_dist

    import hyper_parallel as hp
    ws = dist.get_world_size()
    torch.manual_seed(0)
    full = torch.randn(*SHAPE)
    rows = []
    for name, src, dst in _cases(ws):
        shape = (2, 2) if len(src) == 2 else (ws,)
        mesh = hp.init_device_mesh("cpu", shape)
        tmesh = t_mesh("cpu", shape)
        if src[0].is_partial():
            local = full / ws
            tlocal = local
        else:
            local = hp.distribute_tensor(full, mesh, src).to_local()
            tlocal = t_dist(full, tmesh, _to_torch(src)).to_local()
        ours = lambda: hp.DTensor.from_local(local, mesh, src, shape=SHAPE, stride=(SHAPE[1], 1)).redistribute(mesh, dst)
        theirs = lambda: TDT.from_local(tlocal, tmesh, _to_torch(src), run_check=False, shape=SHAPE,
                                        stride=(SHAPE[1], 1)).redistribute(tmesh, _to_torch(dst))
        expect = full if not src[0].is_partial() else full
        got = ours().full_tensor()
        assert torch.allclose(got, expect, atol=1e-4), name
        assert torch.allclose(theirs().full_tensor(), expect, atol=1e-4), name
        with hp.CommDebugMode() as comm:
            ours()
        t_ours = bench(ours, iters, warmup=2, sync=dist.barrier) / 1e3
        t_torch = bench(theirs, iters, warmup=2, sync=dist.barrier) / 1e3
        used = ", ".join(f"{k} x{v}" for k, v in comm.get_comm_counts().items()) or "none"
        rows.append((name, ws, f"{t_ours:.2f}", f"{t_torch:.2f}", f"{t_ours / t_torch:.2f}",
                     f"{comm.get_total_bytes():,}", used))
    # raw collective baselines on the same bytes (1-D)
    loc = torch.empty(SHAPE[0] // ws, SHAPE[1])
    out = torch.empty(SHAPE)
    a2a_in = torch.empty(SHAPE[0] // ws * SHAPE[1])
    a2a_out = torch.empty_like(a2a_in)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    t_ag = bench(lambda: gather(out, loc), iters, warmup=2, sync=dist.barrier) / 1e3
    t_a2a = bench(lambda: dist.all_to_all_single(a2a_out, a2a_in), iters, warmup=2, sync=dist.barrier) / 1e3
    rows.append(("raw all_gather (same bytes)", ws, f"{t_ag:.2f}", "", "", "", ""))
    rows.append(("raw all_to_all_single", ws, f"{t_a2a:.2f}", "", "", "", ""))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ws", type=int, nargs="+", default=[2, 4])
    a = ap.parse_args()
    rows = []
    for ws in a.ws:
        rows += launch(ws, worker, a.iters)
    print(f"redistribute {SHAPE} fp32, median of 5 x {a.iters} calls")
    print(table(["transition", "ws", "ours ms", "torch ms", "ours/torch", "bytes sent/rank (ours)",
                 "collectives (ours)"], rows))


if __name__ == "__main__":
    main()
