"""``train.py --plan auto``: plan the layout for the launched world with ``hyper_parallel.auto`` and set the flags.

Every rank calibrates the cluster on the launched world (``Cluster.measure()``: matmul throughput and the
collectives' latency / bandwidth; every rank gets the slowest rank's numbers), plans on a meta copy of the
config's model; rank 0's choice is broadcast, so every rank trains the same layout even if a near-tie
between two plans broke differently on another rank; rank 0 prints it. The plan's degrees become the usual
``--dp/--dp-shard/--tp/--sp/--pp*/--cp*/--ep`` flags, and training proceeds (and is compared with one
process) exactly as with hand-written flags. Activation checkpointing is not a flag of this example, so the
plan is searched without it.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import hyper_parallel as hp
from examples.llama.model import Transformer


def choose(args, cfg, world: int, log=print):
    """Plan for ``world`` ranks and write the plan's choices into ``args``; returns the Plan."""
    from hyper_parallel.auto import Cluster, plan
    if world == 1 and "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29512", RANK="0", WORLD_SIZE="1")
    hp.init_process_group("cpu")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    memory = args.device_memory or (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(per_node, 1))
    cluster = Cluster(world, per_node, memory).measure()
    with torch.device("meta"):
        model = Transformer(cfg.model, init_seed=None)
    allowed = ("dp", "fsdp", "tp", "sp", "pp", "cp") + (("ep",) if cfg.model.moe is not None else ())
    if args.compile:  # compiled blocks: no pipeline / cp combinations beyond what --compile supports
        allowed = tuple(a for a in allowed if a not in ("pp", "cp"))
    best = plan(model, cluster, global_batch=cfg.global_batch, seq_len=cfg.seq_len, parallelisms=allowed,
                activation_checkpointing="none", top_k=1)[0]
    # one decision for the world: rank 0's (the ranks' calibrations agree, but a near-tie must not split them)
    choice = [(best.degrees, best.sequence_parallel, best.pp_schedule, best.microbatches, best.cp_method)]
    dist.broadcast_object_list(choice, src=0)
    d, sp, schedule, microbatches, cp_method = choice[0]
    args.dp, args.dp_shard, args.tp, args.pp, args.cp, args.ep = d["dp"], d["fsdp"], d["tp"], d["pp"], d["cp"], d["ep"]
    args.sp = sp
    if d["pp"] > 1:
        args.pp_schedule, args.pp_microbatches = schedule, microbatches
    if d["cp"] > 1:
        args.cp_method = cp_method
    if dist.get_rank() == 0:
        log(f"--plan auto: calibrated {cluster.describe()}")
        log(best.explain())
        log("--plan auto: training with " + (" ".join(best.to_args()) or "(one process layout)"))
    return best
