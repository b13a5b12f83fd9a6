"""DTensor tour on 4 CPU processes: shard a tensor over a 2x2 mesh and move it between layouts.

    torchrun --nproc_per_node 4 examples/dtensor_demo.py

Each step prints every rank's local shard and the collectives the move issued
(counted with hyper_parallel.CommDebugMode), so you can see the planner choose
all_to_all for Shard->Shard, reduce_scatter for Partial->Shard, and no
communication at all for Replicate->Shard. Every step is checked: each rank's
shard must equal the matching ``torch.chunk`` pieces of the full tensor, and
``full_tensor()`` must give back the full tensor; the run fails otherwise.
"""

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard


def expected_local(full, mesh, alias):
    """This rank's piece of ``full`` for an alias layout, cut with torch.chunk (outer mesh dim first)."""
    names, coord = mesh.mesh_dim_names, mesh.get_coordinate()
    t = full
    for dim, spec in enumerate(alias):
        axes = () if spec == "None" else ((spec,) if isinstance(spec, str) else tuple(spec))
        for name in axes:
            i = names.index(name)
            t = t.chunk(mesh.size(i), dim=dim)[coord[i]]
    return t


def check(title, dt, mesh, want_full):
    """Fail loudly unless ``dt`` holds ``want_full`` laid out as its placements say."""
    local = dt.to_local()
    want_local = expected_local(want_full, mesh, dt.alias_placements)
    if not torch.equal(local, want_local):
        raise AssertionError(f"{title}: rank {dist.get_rank()} holds {local.tolist()}, expected {want_local.tolist()}")
    got_full = dt.full_tensor()
    if not torch.equal(got_full, want_full):
        raise AssertionError(f"{title}: full_tensor() is {got_full.tolist()}, expected {want_full.tolist()}")


def show(title, dt, comm=None):
    rank = dist.get_rank()
    lines = [f"rank {rank}: local {tuple(dt.to_local().shape)} {dt.to_local().flatten().tolist()}"]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lines[0])
    if rank == 0:
        used = comm.get_comm_counts() if comm is not None else {}
        print(f"\n== {title}: placements {dt.placements} alias {dt.alias_placements}; collectives {used or 'none'}")
        for g in gathered:
            print("   " + g)


def main():
    torch.set_num_threads(1)
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(16.0).reshape(4, 4)
    x = hp.distribute_tensor(full, mesh, [Shard(0), Replicate()])
    show("distribute_tensor [Shard(0), Replicate()]", x)
    check("distribute_tensor", x, mesh, full)
    checked = 1
    for title, placements in [
        ("rows over dp, columns over tp", [Shard(0), Shard(1)]),
        ("alias spelling: dim 0 over (dp, tp)", (("dp", "tp"), "None")),
        ("same dim, other order: (tp, dp)", (("tp", "dp"), "None")),
        ("columns over both", ("None", ("dp", "tp"))),
        ("replicated everywhere", [Replicate(), Replicate()]),
    ]:
        with hp.CommDebugMode() as comm:
            x = x.redistribute(mesh, placements)
        show(title, x, comm)
        check(title, x, mesh, full)
        checked += 1
    p = hp.DTensor.from_local(torch.ones(4, 4) * (dist.get_rank() + 1), mesh, [Partial(), Partial()])
    with hp.CommDebugMode() as comm:
        s = p.redistribute(mesh, [Shard(0), Shard(1)])
    show("Partial sums reduce-scattered to [Shard(0), Shard(1)] (sum of 1+2+3+4 = 10)", s, comm)
    check("Partial -> Shard", s, mesh, torch.full((4, 4), 10.0))
    checked += 1
    if dist.get_rank() == 0:
        print(f"\nall {checked} layouts checked: every shard and full_tensor() match the full tensor")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
