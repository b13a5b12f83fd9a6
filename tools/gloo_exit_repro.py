"""Plain-torch reproducer of gloo's abort at interpreter exit (issue 26, item 4).

    torchrun --standalone --nproc-per-node 4 tools/gloo_exit_repro.py [--destroy] [--groups N]

What a mesh-using program does: init_process_group("gloo") from torchrun's environment,
``--groups`` subgroups (dist.new_group, as a (2, 2) mesh creates), some synchronous and
asynchronous all_reduces on each, a barrier, then leave main. By default the process groups are
left for the interpreter's teardown to destroy; ``--destroy`` calls
``dist.destroy_process_group()`` at the end of main. ``tools/launch_loop.py`` runs it (or any
command) many times under CPU load and counts the launches that abort with "terminate called
without an active exception".

The cause (a core file's backtrace, docs/testing.md): a gloo worker thread (``runLoop``) drops
its last reference to a finished work object (here the final barrier, which keeps the async
all_reduces before it and so their tensors) *after* ``wait()`` returned on the main thread.
If the main thread is already in ``Py_FinalizeEx`` by then, freeing those tensors' Python objects
takes the GIL, ``take_gil`` ends the thread with ``pthread_exit``, and the forced unwind through
the work's noexcept destructor calls ``std::terminate``. It needs the worker thread to be late,
hence "under load". A process group destroyed before the interpreter finalizes joins its
worker threads first: ``--destroy`` (nothing else referencing the groups) never aborts;
``--keep-refs`` (destroyed, but still referenced, as by a library's group cache) does.
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--destroy", action="store_true", help="dist.destroy_process_group() at the end of main")
p.add_argument("--keep-refs", action="store_true",
               help="keep the group objects referenced past --destroy (as a library's group cache does)")
p.add_argument("--hp", action="store_true",
               help="the same through hyper_parallel: init_device_mesh (2, world/2), DTensor ops, no destroy")
p.add_argument("--groups", type=int, default=4, help="subgroups to create (dist.new_group)")
p.add_argument("--iters", type=int, default=5)
a = p.parse_args()

torch.set_num_threads(1)
if a.hp:
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (2, int(os.environ["WORLD_SIZE"]) // 2), mesh_dim_names=("dp", "tp"))
    x = hp.distribute_tensor(torch.randn(64, 32), mesh, [hp.Shard(0), hp.Shard(1)])
    for _ in range(a.iters):
        y = (x @ x.transpose(0, 1)).sum(dim=1)
        x = x + y.full_tensor().mean() * 1e-3
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"gloo_exit_repro --hp: mesh {tuple(mesh.shape)}, done", flush=True)
    raise SystemExit(0)  # no destroy: hyper_parallel's exit hook does it (distributed/launch.py)

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
groups = []
for i in range(a.groups):  # alternate "rows" and "columns" of a 2-D mesh, each a collective new_group
    half = max(world // 2, 1)
    parts = [list(range(s, s + half)) for s in range(0, world, half)] if i % 2 == 0 else \
        [list(range(s, world, half)) for s in range(half)]
    for ranks in parts:
        g = dist.new_group(ranks)
        if rank in ranks:
            groups.append(g)
t = torch.ones(1000)
for _ in range(a.iters):
    dist.all_reduce(t)
    works = [dist.all_reduce(torch.ones(100), group=g, async_op=True) for g in groups]
    for w in works:
        w.wait()
    t /= world
dist.barrier()
if rank == 0:
    print(f"gloo_exit_repro: world {world}, {len(groups)} subgroups per rank, done", flush=True)
if a.destroy:
    dist.destroy_process_group()
if a.keep_refs:
    KEEP = groups  # still referenced at teardown: destroy_process_group could not free them
