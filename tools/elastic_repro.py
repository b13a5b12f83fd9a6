"""Plain-torch reproducer: a torchrun restart hangs once the first round created a subgroup.

    torchrun --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:29555 tools/elastic_repro.py [--subgroup] [--fresh-store]

Round 0: init_process_group, optionally dist.new_group, an all_reduce, then rank 1 SIGKILLs
itself. torchrun tears the group down and starts round 1 (TORCHELASTIC_RESTART_COUNT=1), which
does the same without the kill and prints "round 1 ok".

What happens with torch 2.13 on gloo (docs/checkpoint.md, "Elastic restart"): round 1 first prints
the keys it finds already set in torchrun's shared agent store (MASTER_ADDR:MASTER_PORT is the same
server in every round), e.g. ``default_pg/0//cpu//0/0`` and, after a subgroup,
``default_pg/0//1//cpu//0/0``: gloo's address exchange of round 0. init_process_group then reads
a dead process's address and fails in connectFullMesh ("Connection refused" / "Connect
timeout"). ``--fresh-store`` gives each attempt a PrefixStore of its own over a client of the same
store (what hyper_parallel's process-group initialisation does) and round 1 succeeds.
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (rank 0 hosts a new store every round) also succeeds.
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--subgroup", action="store_true", help="create a dist.new_group in every round")
p.add_argument("--fresh-store", action="store_true",
               help="give init_process_group a PrefixStore of its own per restart attempt")
p.add_argument("--timeout", type=float, default=30)
a = p.parse_args()

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
t0 = time.time()
print(f"[round {attempt} rank {rank}] start pid {os.getpid()} master "
      f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
      f"use_agent_store={os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}", flush=True)
if attempt > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
    # what the restarted round finds in the agent's store before it initialises anything
    probe = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=5))
    # torch's keys for gloo's address exchange: "default_pg" (init_process_group's PrefixStore),
    # group name "0" (the world) or "0//1" (the first new_group), then gloo's "cpu//0/<rank>"
    stale = [k for g in ("0", "0//1") for r in range(world) if probe.check([k := f"default_pg/{g}//cpu//0/{r}"])]
    print(f"[round {attempt} rank {rank}] store already holds {probe.num_keys()} keys, e.g. {stale}", flush=True)
    del probe
if a.fresh_store:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=a.timeout)) \
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else \
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                      timeout=timedelta(seconds=a.timeout))
    store = dist.PrefixStore(f"attempt{attempt}/", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=a.timeout))
else:
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
print(f"[round {attempt} rank {rank}] init_process_group done {time.time() - t0:.1f}s", flush=True)
if a.subgroup:
    g = dist.new_group(list(range(world)))
    print(f"[round {attempt} rank {rank}] new_group done {time.time() - t0:.1f}s", flush=True)
t = torch.ones(1)
dist.all_reduce(t)
if a.subgroup:
    dist.all_reduce(t, group=g)
print(f"[round {attempt} rank {rank}] all_reduce {t.item()}", flush=True)
if attempt == 0 and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
if attempt == 0:
    time.sleep(60)  # rank 0 waits for torchrun to tear the round down
    sys.exit(3)
dist.barrier()
dist.destroy_process_group()
print(f"[round {attempt} rank {rank}] round {attempt} ok", flush=True)
