"""The example's training loop as one torchft replica group (``train.py --ft-replica-group-id G --ft-lighthouse ADDR``).

Each replica group is its own torchrun job of ``--dp-shard x --tp`` ranks (FSDP, and TP, inside the
group); the groups meet only through torchft (``hyper_parallel.ft``): a lighthouse forms the quorum of
live groups every step, each FSDP module's reduced gradients are averaged over the groups by the
all-reduce hook, the optimizer commits a step only when the quorum agrees, and a group that
(re)starts heals from a live one: model, optimizer, RNG and the data position (the step number).
Group ``G`` of ``--ft-num-replica-groups N`` trains on slice ``G`` of every global batch.

``--ft-semi-sync diloco|localsgd --sync-every H``: the groups train on their own and torchft's
DiLoCo / LocalSGD synchronise them every H steps (docs/fault_tolerance.md, "Replica groups").

``--ft-log FILE`` writes one JSON line per attempted step (rank 0 of the group: step, committed,
loss, participants, seconds, cross-group bytes, digests of the model, optimizer and RNG state).
``HP_TEST_FT_KILL_AT_STEP=STEP`` (tests): every rank of the group SIGKILLs itself inside the
backward of that step (at the first transformer block's backward). ``HP_FT_START_GATE=PATH``:
a spare group builds its model and then waits for PATH before it joins (tests, scripts/ft_demo.sh); ``HP_TEST_FT_STEP_SLEEP=S``:
sleep S seconds after each step (the tiny test model steps far faster than a real one).
"""
from __future__ import annotations

import json
import os
import signal
import time

import torch
import torch.distributed as dist

import hyper_parallel as hp
from examples.llama.configs import get_config
from examples.llama.data import TokenBatches, dp_shard
from examples.llama.model import build_model, loss_fn
from examples.llama.parallelize import parallelize_llama, train_loss
from examples.llama.reference import build_optimizer


def add_ft_args(parser) -> None:
    """The ``--ft-*`` options of train.py."""
    g = parser.add_argument_group("fault tolerance across replica groups (torchft; docs/fault_tolerance.md)")
    g.add_argument("--ft-replica-group-id", type=int, default=None,
                   help="run as replica group G (0 <= G < --ft-num-replica-groups) of a torchft job")
    g.add_argument("--ft-lighthouse", default=None, help="address of the torchft lighthouse (HOST:PORT)")
    g.add_argument("--ft-num-replica-groups", type=int, default=2, help="replica groups in the job (default 2)")
    g.add_argument("--ft-min-replicas", type=int, default=None,
                   help="fewest groups a step may commit with (default: a majority, n // 2 + 1)")
    g.add_argument("--ft-semi-sync", default="none", choices=("none", "diloco", "localsgd"),
                   help="synchronise the groups every --sync-every steps (torchft DiLoCo / LocalSGD)")
    g.add_argument("--sync-every", type=int, default=8, help="inner steps between semi-synchronous syncs")
    g.add_argument("--ft-outer-lr", type=float, default=0.7, help="DiLoCo's outer Nesterov SGD learning rate")
    g.add_argument("--ft-outer-momentum", type=float, default=0.5,
                   help="DiLoCo's outer Nesterov momentum (0.5: the paper's 0.9 lags over a short run's few outer steps)")
    g.add_argument("--ft-timeout", type=float, default=30.0, help="seconds for a cross-group collective or heal")
    g.add_argument("--ft-quorum-timeout", type=float, default=60.0,
                   help="seconds to wait for a quorum of --ft-min-replicas groups before failing")
    g.add_argument("--ft-alone-timeout", type=float, default=300.0,
                   help="seconds a fresh or restarted group waits for a live group to heal from before it fails")
    g.add_argument("--ft-log", default=None, help="write one JSON line per attempted step (rank 0 of the group)")


def check_ft_args(args, world: int) -> None:
    """Flag checks before any process group exists (every rank alike)."""
    n = args.ft_num_replica_groups
    if n < 1:
        raise SystemExit(f"--ft-num-replica-groups must be >= 1, got {n}")
    if not 0 <= args.ft_replica_group_id < n:
        raise SystemExit(f"--ft-replica-group-id {args.ft_replica_group_id} is out of range: expected 0 <= G < "
                         f"--ft-num-replica-groups {n}")
    if not args.ft_lighthouse:
        raise SystemExit("--ft-replica-group-id needs --ft-lighthouse HOST:PORT (a running torchft_lighthouse; "
                         "scripts/ft_demo.sh starts one)")
    if args.dp != 1 or args.pp != 1 or args.cp != 1 or args.ep != 1 or args.plan != "manual":
        raise SystemExit("--ft-replica-group-id: inside a replica group use --dp-shard (FSDP) and --tp; the "
                         "replicate dimension is the replica groups (got --dp/--pp/--cp/--ep/--plan)")
    if args.dp_shard * args.tp != world:
        raise SystemExit(f"--dp-shard {args.dp_shard} x --tp {args.tp} must equal the group's processes ({world})")
    if args.sync_every < 1:
        raise SystemExit(f"--sync-every must be >= 1, got {args.sync_every}")


def _kill_in_backward(model, step: int) -> None:
    """``HP_TEST_FT_KILL_AT_STEP``: SIGKILL this rank in the backward of that step (first block's backward)."""
    spec = os.environ.get("HP_TEST_FT_KILL_AT_STEP")
    if not spec or int(spec) != step:
        return
    block = next(iter(model.layers.values()))

    def die(*_):
        print(f"HP_TEST_FT_KILL_AT_STEP: rank {dist.get_rank()} kills itself in the backward of step {step}",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    block.register_full_backward_pre_hook(die)


def _test_start_gate() -> None:
    """``HP_FT_START_GATE=PATH`` (tests, the demo script): a spare group, started and built early, joins only once PATH exists."""
    gate = os.environ.get("HP_FT_START_GATE")
    while gate and not os.path.exists(gate):
        time.sleep(0.05)


def build(args, cfg):
    """The group's mesh, sharded model (FSDP over dp_shard, TP over tp) and plain optimizer."""
    mesh = hp.init_device_mesh("cpu", (args.dp_shard, args.tp), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(cfg.seed)
    hp.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.seed)
    parallelize_llama(model, mesh, sequence_parallel=args.sp, loss_parallel=args.loss_parallel, src_data_rank=None)
    if args.dp_shard == 1:  # FSDP over a 1-rank dim: the FSDP modules carry the cross-group hook
        for block in model.layers.values():
            hp.fully_shard(block, mesh=mesh["dp_shard"])
        hp.fully_shard(model, mesh=mesh["dp_shard"])
    return mesh, model, build_optimizer(model.parameters(), cfg.optim)


def train_ft(args, steps: int, cfg, log=print) -> list:
    """The replica group's training loop; returns the committed steps' losses (this group's mean)."""
    from hyper_parallel import ft
    group, n_groups = args.ft_replica_group_id, args.ft_num_replica_groups
    mesh, model, opt = build(args, cfg)
    _test_start_gate()
    manager = ft.make_manager(replica_group_id=group, num_replica_groups=n_groups, lighthouse=args.ft_lighthouse,
                              min_replicas=args.ft_min_replicas, timeout_s=args.ft_timeout,
                              quorum_timeout_s=args.ft_quorum_timeout)
    ft.register_healing(manager, model, opt)
    semi = args.ft_semi_sync != "none"
    if semi:
        ctx = ft.semi_sync(args.ft_semi_sync, manager, model, opt, args.sync_every, outer_lr=args.ft_outer_lr,
                           outer_momentum=args.ft_outer_momentum, alone_timeout_s=args.ft_alone_timeout)
        counter = ft.count_cross_group_bytes(manager)
        ft_opt = None
    else:
        counter = ft.replicate_over_groups(model, manager)
        ft_opt = ft.FTOptimizer(manager, opt, alone_timeout_s=args.ft_alone_timeout)
    inner, inner_rank = mesh["dp_shard"].size(), mesh.get_local_rank("dp_shard")
    world = dist.get_world_size()
    data = TokenBatches(seed=cfg.seed)
    out = open(args.ft_log, "a") if args.ft_log and dist.get_rank() == 0 else None
    losses = []
    t0 = time.perf_counter()
    local_step = 0
    try:
        if semi:
            ctx.__enter__()
            manager.start_quorum()  # the first quorum: a (re)started group heals before it trains
            ft.check_same_model(manager)
        while True:
            t_quorum = time.perf_counter()
            if not semi:
                ft_opt.zero_grad(set_to_none=True)  # the quorum (a restarted group heals here)
            t_quorum = time.perf_counter() - t_quorum
            step = manager.current_step() if not semi else local_step
            if step >= steps:
                break
            _kill_in_backward(model, step)
            x, y = data.get_batch(step, cfg.global_batch, cfg.seq_len)
            x, y = dp_shard(x, group, n_groups), dp_shard(y, group, n_groups)  # this group's slice
            x, y = dp_shard(x, inner_rank, inner), dp_shard(y, inner_rank, inner)
            if semi:
                opt.zero_grad(set_to_none=True)
            t_step = time.perf_counter()
            loss = train_loss(model, x, y, loss_fn, loss_parallel=args.loss_parallel).clone()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
            before = manager.current_step()
            if semi:
                opt.step()  # the DiLoCo hooks sync every --sync-every steps
                committed, participants = True, manager.num_participants()
                local_step += 1
            else:
                ft_opt.step()
                committed, participants = ft_opt.last_committed, ft_opt.participants
            dist.all_reduce(loss)  # every tp rank holds the same loss
            loss = loss.item() / world
            if committed:
                losses.append(loss)
            rec = {"group": group, "step": step, "committed": committed, "loss": loss, "participants": participants,
                   "seconds": time.perf_counter() - t_step, "quorum_seconds": t_quorum, "time": time.time(), "bytes": counter.total,
                   "manager_step": manager.current_step(), "manager_step_before": before}
            if args.ft_log:
                rec["digest"] = ft.state_digest(model, opt)
                if dist.get_rank() != 0:  # rank 0 writes; the other ranks' digests go to their own files
                    with open(f"{args.ft_log}.rank{dist.get_rank()}", "a") as f:
                        f.write(json.dumps(rec) + "\n")
            if out is not None:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            if os.environ.get("HP_TEST_FT_STEP_SLEEP"):  # tests: pace the steps like a real model's
                time.sleep(float(os.environ["HP_TEST_FT_STEP_SLEEP"]))
            log(step, steps, loss, 0.0, note=f"group {group}: {'committed' if committed else 'NOT committed'}, "
                                             f"{participants} group(s) in the quorum")
    finally:
        if semi:
            ctx.__exit__(None, None, None)
        if out is not None:
            out.close()
        manager.shutdown(wait=False)
    log(None, steps, f"group {group}: {len(losses)} committed steps in {time.perf_counter() - t0:.1f}s, "
                     f"{counter.total:,} cross-group bytes sent", 0)
    return losses


def main_ft(args) -> None:
    """train.py's entry point with ``--ft-replica-group-id``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_ft_args(args, world)
    torch.set_num_threads(1)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        raise SystemExit("--ft-replica-group-id: launch each group with torchrun (even with one process), so that "
                         "the group has its own TCPStore (MASTER_ADDR/MASTER_PORT); scripts/ft_demo.sh does")
    cfg = get_config(args.config)
    steps = args.steps or cfg.steps
    from examples.llama.train import progress
    rank = int(os.environ.get("RANK", "0"))
    quiet = lambda *a, **k: None
    losses = train_ft(args, steps, cfg, log=progress if rank == 0 else quiet)
    if rank == 0 and losses:
        print(f"group {args.ft_replica_group_id}: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
