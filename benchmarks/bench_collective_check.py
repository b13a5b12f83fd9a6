"""Cost of the desync check (HYPER_PARALLEL_CHECK_COLLECTIVES=1) and of the error wrapping, per collective.

    python benchmarks/bench_collective_check.py [--ws 2] [--iters 200] [--repeats 9]

Same processes, interleaved blocks (see common.py), median microseconds per call on ``--ws`` gloo ranks:

* ``torch.distributed.all_reduce`` of a tensor (the baseline), the library's ``all_reduce`` (clone +
  the ``try/except`` wrapping: the error-path cost on the healthy path) with the check off, and on;
* a DTensor ``Partial -> Replicate`` redistribution (one all_reduce) and ``Shard(0) -> Replicate``
  (one all_gather), check off / on;
* a TP MLP training step (Colwise + Rowwise, forward + backward + SGD: one all_reduce), check off / on.

The check adds one all_gather of a 64-bit hash per collective plus building the description (a walk
of the Python stack for the call site and placements); its cost per collective is the ``on - off``
column, and the row "description + hash only" times the local part alone.
"""
from __future__ import annotations

import argparse

from common import bench_interleaved, launch, table


def _run(iters, repeats):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import hyper_parallel as hp
    from hyper_parallel import Partial, Replicate, Shard
    from hyper_parallel.distributed import collective_errors as faults
    from hyper_parallel.distributed import collectives as C

    ws = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    grp = mesh.get_comm_group(0)
    rows = []

    def pair(name, fn, n_coll, size):
        def off():
            faults.CHECK[0] = False
            fn()

        def on():
            faults.CHECK[0] = True
            fn()
            faults.CHECK[0] = False
        t_off, t_on = bench_interleaved([off, on], iters, repeats, sync=dist.barrier)
        rows.append((name, size, f"{t_off:.1f}", f"{t_on:.1f}", f"{(t_on - t_off) / n_coll:.1f}",
                     f"{t_on / t_off:.2f}"))

    for numel in (16, 65536):
        x = torch.ones(numel)
        [t_raw, t_lib] = bench_interleaved([lambda: dist.all_reduce(x.clone(), group=grp.handle),
                                            lambda: C.all_reduce(x, grp)], iters, repeats, sync=dist.barrier)
        rows.append((f"torch all_reduce (clone) vs ours, check off", f"{numel} fp32", f"{t_raw:.1f}",
                     f"{t_lib:.1f}", f"{t_lib - t_raw:.1f}", f"{t_lib / t_raw:.2f}"))
        pair("ours all_reduce: check off / on", lambda: C.all_reduce(x, grp), 1, f"{numel} fp32")

    for shape in ((4, 4), (256, 256)):
        local = torch.ones(shape)
        pair("DTensor Partial->Replicate", lambda: hp.DTensor.from_local(local, mesh, [Partial()]).redistribute(
            mesh, [Replicate()]), 1, f"{shape} fp32")
        pair("DTensor Shard(0)->Replicate", lambda: hp.DTensor.from_local(local, mesh, [Shard(0)]).redistribute(
            mesh, [Replicate()]), 1, f"{shape} local fp32")

    from hyper_parallel.distributed import collective_guard as F
    xs = torch.ones(16)
    [t_desc] = bench_interleaved([lambda: F._hash(F.describe("all_reduce", grp, xs, "op sum"))], iters * 5, repeats)
    rows.append(("description + hash only (no communication)", "16 fp32", "-", f"{t_desc:.1f}", f"{t_desc:.1f}", "-"))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    hp.parallelize_module(model, mesh, {"0": hp.ColwiseParallel(), "2": hp.RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xb = torch.randn(32, 64)

    def step():
        model(xb).sum().backward()
        opt.step()
        opt.zero_grad()
    with hp.CommDebugMode() as comm:
        step()
    n = sum(comm.get_comm_counts().values())
    pair(f"TP MLP train step ({n} collective)", step, n, "64-256-64, batch 32")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ws", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args()
    rows = launch(a.ws, _run, a.iters, a.repeats)
    print(f"{a.ws} gloo ranks, {a.iters} calls x {a.repeats} blocks, median us per call")
    print(table(["case", "size", "off / baseline (us)", "on / ours (us)", "added per collective (us)", "ratio"],
                rows))


if __name__ == "__main__":
    main()
