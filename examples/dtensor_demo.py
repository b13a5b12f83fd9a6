"""DTensor tour on 4 CPU processes: shard a tensor over a 2x2 mesh and move it between layouts.

    torchrun --nproc_per_node 4 examples/dtensor_demo.py

Each step prints every rank's local shard and the collectives the move issued
(counted with hyper_parallel.CommDebugMode), so you can see the planner choose
all_to_all for Shard->Shard, reduce_scatter for Partial->Shard, and no
communication at all for Replicate->Shard.
"""

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard


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
    p = hp.DTensor.from_local(torch.ones(4, 4) * (dist.get_rank() + 1), mesh, [Partial(), Partial()])
    with hp.CommDebugMode() as comm:
        s = p.redistribute(mesh, [Shard(0), Shard(1)])
    show("Partial sums reduce-scattered to [Shard(0), Shard(1)] (sum of 1+2+3+4 = 10)", s, comm)
    assert torch.equal(x.full_tensor(), full)
    if dist.get_rank() == 0:
        print("\nfull_tensor() round trip OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
