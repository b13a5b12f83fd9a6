"""Cross-mesh redistribution: point-to-point plan vs gathering the whole tensor.

    python benchmarks/bench_cross_mesh.py [--iters 5]

(1024, 1024) fp32 on 8 gloo ranks. For each case: ms per forward call, ms per
forward + backward, the planned bytes (total, and the most one rank sends) and
messages, and the naive alternative where one exists: ``full_tensor()`` on the
source mesh then a local slice on the target (an all_gather of the whole
tensor; only possible when every target rank is on the source mesh).
PyTorch's DTensor refuses cross-mesh redistribution, so it has no column here.
"""
from __future__ import annotations

import argparse

from common import bench, launch, table

SHAPE = (1024, 1024)
STRIDE = (SHAPE[1], 1)
MESHES = {"2x4": [[0, 1, 2, 3], [4, 5, 6, 7]], "4x2": [[0, 1], [2, 3], [4, 5], [6, 7]], "8": list(range(8)),
          "a4": [0, 1, 2, 3], "b4": [4, 5, 6, 7]}


def _cases():
    from hyper_parallel import Partial as P, Replicate as R, Shard as S
    return [("(2,4)[S0,S1] -> (4,2)[S0,S1]", "2x4", [S(0), S(1)], "4x2", [S(0), S(1)]),
            ("(8,)[S0] -> (2,4)[S1,S0]", "8", [S(0)], "2x4", [S(1), S(0)]),
            ("(2,4)[S0,R] -> (8,)[S1]", "2x4", [S(0), R()], "8", [S(1)]),
            ("stage [0-3] S0 -> [4-7] S0", "a4", [S(0)], "b4", [S(0)]),
            ("stage [0-3] R -> [4-7] S1", "a4", [R()], "b4", [S(1)]),
            ("stage [0-3] P -> [4-7] S0", "a4", [P()], "b4", [S(0)])]


def worker(iters):
    import torch
    import torch.distributed as dist

    import hyper_parallel as hp
    from hyper_parallel.dtensor import cross_mesh_plan as cmp
    from hyper_parallel.dtensor.dtensor import build_layout

    rank = dist.get_rank()
    meshes = {k: hp.DeviceMesh("cpu", v) for k, v in MESHES.items()}
    torch.manual_seed(0)
    full = torch.randn(*SHAPE)
    rows = []
    for name, a, pa, b, pb in _cases():
        ma, mb = meshes[a], meshes[b]
        src = build_layout(ma, pa, 2)
        in_a = ma.get_coordinate() is not None
        if in_a:
            local = hp.distribute_tensor(full, ma, [p if not p.is_partial() else hp.Replicate() for p in pa])
            local = local.to_local().clone()
        else:
            local = torch.empty(0)
        leaf = local.clone().requires_grad_(True)

        def make(x_local):
            if in_a:
                return hp.DTensor.from_local(x_local, ma, pa, shape=SHAPE, stride=STRIDE)
            return hp.DTensor._wrap(x_local, ma, src, SHAPE)  # a rank off the source mesh: empty shard

        fwd = lambda: make(local).redistribute(mb, pb)  # noqa: E731

        def fwd_bwd():
            y = make(leaf).redistribute(mb, pb)
            y.to_local().sum().backward()

        t_f = bench(fwd, iters, warmup=2, sync=dist.barrier) / 1e3
        t_fb = bench(fwd_bwd, iters, warmup=2, sync=dist.barrier) / 1e3
        naive = ""
        if set(mb.rank_list) <= set(ma.rank_list) and not pa[0].is_partial():
            dst = build_layout(mb, pb, 2)

            def gather_slice():
                f = make(local).full_tensor()
                shape, off = dst.local_shape_and_offset(SHAPE, rank)
                return f[off[0]:off[0] + shape[0], off[1]:off[1] + shape[1]].clone()

            naive = f"{bench(gather_slice, iters, warmup=2, sync=dist.barrier) / 1e3:.2f}"
        plan = cmp.cross_mesh_plan(src, build_layout(mb, pb, 2), SHAPE, 4)
        rows.append((name, f"{t_f:.2f}", f"{t_fb:.2f}", naive, f"{plan.moves.total_bytes:,}",
                     f"{plan.moves.max_bytes():,}", len(plan.moves.messages()),
                     (f"reduced to {list(plan.pre_layout.placements)} first: {[s.kind for s in plan.pre_steps.steps]}" if plan.reduces_first else "")))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    rows = launch(8, worker, a.iters)
    print(f"cross-mesh redistribute {SHAPE} fp32 on 8 ranks, median of 5 x {a.iters} calls")
    print(table(["case", "fwd ms", "fwd+bwd ms", "gather+slice ms", "bytes (total)", "max bytes/rank",
                 "messages", "note"], rows))


if __name__ == "__main__":
    main()
