"""Train the example Llama with data x tensor (x sequence) parallelism on CPU processes.

    torchrun --nproc_per_node 4 examples/llama/train.py --dp 2 --tp 2 --sp --steps 40
    torchrun --nproc_per_node 4 examples/llama/train.py --dp-shard 2 --tp 2 --sp --steps 40   # FSDP x TP
    torchrun --nproc_per_node 4 examples/llama/train.py --pp 2 --tp 2 --sp --pp-schedule 1f1b   # pipeline x TP
    torchrun --nproc_per_node 4 examples/llama/train.py --config long --cp 4 --cp-method hybrid   # context parallel
    torchrun --nproc_per_node 4 examples/llama/train.py --config moe-tiny --dp-shard 4 --ep 2      # expert parallel
    torchrun --nproc_per_node 4 examples/llama/train.py --plan auto        # hyper_parallel.auto picks the layout

``--pp N`` (with ``--pp-schedule``, ``--pp-microbatches``, ``--pp-layers-per-stage``) splits the
model into pipeline stages on a ("pp", "dp_shard", "tp") mesh: examples/llama/pipeline.py.

``--cp N --cp-method {ring,ulysses,hybrid}`` shards every sequence over N ranks
(context parallelism: examples/llama/context_parallel.py, docs/context_parallel.md "The example
with --cp"): mesh ("dp", ["dp_shard"], "cp" or "cp_ulysses", "cp_ring", "tp"); composes with
``--tp`` (heads by tp, sequence by cp), ``--dp-shard`` (FSDP over the flattened (dp_shard, cp)
dims) or ``--dp`` (gradients averaged over the flattened (dp, cp) dims). (--- end CP)
--- CP x PP: ``--pp N --cp M`` (ring): mesh ("pp", "dp_shard", "cp", "tp"), CP inside each stage
(examples/llama/pipeline.py, docs/pipelining.md "With context parallelism").

``--dp`` replicates (gradients all-reduced), ``--dp-shard`` fully shards
parameters, gradients and optimizer states (``fully_shard`` per block and root);
both together are HSDP (dp_replicate x dp_shard x tp). With ``--dp-shard`` rank 0
prints every rank's parameter + gradient + optimizer-state bytes next to the
unsharded total.

Every rank builds the same model (same seed), ``parallelize_llama`` shards it
over a ("dp", "tp") mesh, and AdamW with gradient clipping trains it on the
rank's share of each global batch. Rank 0 prints a progress bar, writes the
loss curve (CSV + PNG) and finally trains the same model for the same steps in
one process and prints the largest loss difference. ``--loss-parallel``
computes the cross-entropy on the vocabulary-sharded logits (no gather of the
vocabulary); ``--out PREFIX`` sets where ``PREFIX.csv``/``PREFIX.png`` go.
``--checkpoint-dir DIR --save-every K`` saves DCP checkpoints (``DIR/step-NNNNNN`` and a
``DIR/latest`` marker written after each completed save); ``--resume`` continues from
``DIR/latest`` under any ``--dp/--tp`` (see docs/checkpoint.md).

Mixture of experts (``--config moe-tiny`` / ``moe-demo``, examples/llama/moe.py, docs/moe_example.md):

    torchrun --nproc_per_node 4 examples/llama/train.py --config moe-demo --dp-shard 4 --ep 2 --steps 40
    torchrun --nproc_per_node 4 examples/llama/train.py --config moe-demo --dp-shard 2 --ep 2 --tp 2

``--ep N`` shards the routed experts over N ranks borrowed from ``--dp-shard`` (N must divide it,
and the number of experts): the experts are fully sharded over the remaining dp_shard/N ranks,
everything else over all dp_shard ranks; with ``--tp`` the experts are replicated over tp, or
tensor parallel inside each expert with ``--expert-tp`` (``ExpertTensorParallel`` on (ep, tp)).
``--ep`` does not combine with ``--dp`` (HSDP). After each step the per-expert bias (aux-loss-free
balancing) is updated from the global token counts (one all_reduce) and rank 0 prints the expert
load (tokens per expert and max/mean per MoE layer) with the progress line.

Replica groups that survive a lost group without a restart (torchft; docs/fault_tolerance.md):
``scripts/ft_demo.sh`` starts a ``torchft_lighthouse`` and N groups, each a torchrun job of
``torchrun --nproc_per_node M examples/llama/train.py --dp-shard M --ft-replica-group-id G
--ft-num-replica-groups N --ft-lighthouse HOST:PORT`` (``--ft-semi-sync diloco --sync-every H``:
DiLoCo across the groups); examples/llama/fault_tolerant.py.

Multi-node: run the same command on every node with
``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT
--rdzv-id JOB examples/llama/train.py ...`` (dp * dp_shard * tp = N * P; tp dividing P keeps
each tensor-parallel group within a node; docs/multi_node.md). Elastic restart: add
``--max-restarts K`` and ``--checkpoint-dir D --save-every S --resume`` (docs/checkpoint.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # make `examples.llama` importable when run as a script
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hyper_parallel as hp  # noqa: E402
from examples.llama.configs import get_config  # noqa: E402
from examples.llama.data import TokenBatches, dp_shard  # noqa: E402
from examples.llama.model import build_model, loss_fn  # noqa: E402
from examples.llama.parallelize import parallelize_llama, train_loss  # noqa: E402
from examples.llama.reference import build_optimizer, train_reference  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="DP x TP (+SP) training of the example Llama on CPU")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    p.add_argument("--dp-shard", type=int, default=1,
                   help="fully sharded data-parallel degree (fully_shard; with --dp: HSDP)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE configs; ranks borrowed "
                   "from --dp-shard, which it must divide)")
    p.add_argument("--expert-tp", action="store_true", help="with --ep and --tp: experts tensor parallel over tp "
                   "(ExpertTensorParallel) instead of replicated")
    p.add_argument("--sp", action="store_true", help="sequence parallelism for norms/activations")
    p.add_argument("--loss-parallel", action="store_true",
                   help="cross-entropy on the vocabulary-sharded logits (no vocabulary gather)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
    p.add_argument("--config", default="demo", help="model/training config: tiny, demo, moe-tiny, moe-demo or long")
    p.add_argument("--out", default=str(ROOT / "examples" / "out" / "loss"), help="prefix for loss CSV/PNG")
    p.add_argument("--no-compare", action="store_true", help="skip the single-process comparison")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile each transformer block (torchtitan style; default backend: inductor)")
    p.add_argument("--checkpoint-dir", default=None, help="save DCP checkpoints as DIR/step-NNNNNN (+ DIR/latest)")
    p.add_argument("--save-every", type=int, default=0, help="save every K steps (and after the last) when "
                   "--checkpoint-dir is set; 0: only after the last step")
    p.add_argument("--resume", action="store_true", help="resume from DIR/latest (any --dp/--tp layout)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability on the embeddings, each residual "
                   "branch and the attention weights (default 0: none; >0 skips the single-process comparison)")
    # --- pipeline parallelism: --pp, --pp-schedule, --pp-microbatches, --pp-layers-per-stage (pipeline.py)
    from examples.llama.pipeline import add_pp_args
    add_pp_args(p)
    # --- CP
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree (sequence sharded over cp ranks)")
    p.add_argument("--cp-method", default="ring", choices=("ring", "ulysses", "hybrid"),
                   help="context-parallel attention (hybrid: a 2-D (ulysses, ring) cp mesh, --cp 4 -> (2, 2))")
    # --- end CP
    # --- auto-parallel: hyper_parallel.auto picks the flags above for the launched world (auto_plan.py)
    p.add_argument("--plan", default="manual", choices=("manual", "auto"),
                   help="auto: plan dp/fsdp/tp/sp/pp/cp/ep for the launched world (hyper_parallel.auto, calibrated "
                        "with Cluster.measure()) instead of the flags")
    p.add_argument("--device-memory", default=None, help="with --plan auto: per-rank memory (e.g. 4GiB); default: "
                   "this machine's RAM / processes per node")
    # --- fault tolerance across replica groups (torchft): --ft-* (examples/llama/fault_tolerant.py)
    from examples.llama.fault_tolerant import add_ft_args
    add_ft_args(p)
    return p.parse_args(argv)


def make_mesh(args):
    """("dp", "tp") mesh, or ("dp", "dp_shard", "tp") when --dp-shard is given ("pp", "dp_shard", "tp" with --pp; ("dp", ["dp_shard"], "cp"..., "tp") with --cp;
    ("efsdp", "ep", "tp") with --ep: expert parallelism borrows ranks from dp_shard)."""
    if getattr(args, "pp", 1) > 1:  # --- pipeline parallelism
        from examples.llama.pipeline import make_mesh as make_pp_mesh
        return make_pp_mesh(args)
    if getattr(args, "ep", 1) > 1:  # --- MoE expert parallelism
        from examples.llama.parallelize import make_moe_mesh
        return make_moe_mesh("cpu", args.dp_shard, args.ep, args.tp)
    if getattr(args, "cp", 1) > 1:  # --- CP: ("dp", ["dp_shard"], "cp" | "cp_ulysses", "cp_ring", "tp")
        from examples.llama.context_parallel import cp_dim_names, cp_mesh_shape
        ds = args.dp_shard > 1
        shape = (args.dp,) + ((args.dp_shard,) if ds else ()) + cp_mesh_shape(args.cp, args.cp_method) + (args.tp,)
        names = ("dp",) + (("dp_shard",) if ds else ()) + cp_dim_names(args.cp_method) + ("tp",)
        return hp.init_device_mesh("cpu", shape, mesh_dim_names=names)
    if getattr(args, "dp_shard", 1) > 1:
        return hp.init_device_mesh("cpu", (args.dp, args.dp_shard, args.tp), mesh_dim_names=("dp", "dp_shard", "tp"))
    return hp.init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))


# ---- multi-node placement (docs/multi_node.md) ------------------------------------------------------
def node_placement(mesh):
    """On a multi-node launch (torchrun ``GROUP_WORLD_SIZE`` > 1): a line saying which node
    (``GROUP_RANK``) holds each rank and whether every group of the innermost mesh dim (tp) lies
    within one node; None on one node. Collective (``all_gather_object``) on multi-node launches.

    torchrun numbers ranks node by node (node ``g`` holds ``g * P .. g * P + P - 1`` for P processes
    per node) and ``init_device_mesh`` lays ranks out row-major, so the innermost dim stays within
    a node exactly when its size divides P."""
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) <= 1:
        return None
    nodes = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ["GROUP_RANK"]))
    inner = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()
    within = all(len({nodes[r] for r in row}) == 1 for row in inner)
    name = mesh.mesh_dim_names[-1] if mesh.mesh_dim_names else str(mesh.ndim - 1)
    msg = (f"multi-node: {len(set(nodes))} nodes x {os.environ.get('LOCAL_WORLD_SIZE')} processes, node of each rank "
           f"{nodes}; innermost mesh dim {name!r} groups {inner} each within one node: {'yes' if within else 'NO'}")
    if not within:
        msg += f" (WARNING: make the {name} degree divide the processes per node; docs/multi_node.md)"
    return msg
# ------------------------------------------------------------------------------------------------


def state_bytes(model, opt):
    """This rank's bytes of parameters, gradients and optimizer states (local shards)."""
    local = lambda t: t._local_tensor if isinstance(t, hp.DTensor) else t
    n = 0
    for p in model.parameters():
        n += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            n += local(p.grad).numel() * local(p.grad).element_size()
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                n += local(v).numel() * local(v).element_size()
    return n


def train(args, steps, cfg, mesh, log=print, report=None):
    """Distributed training loop; returns the global mean loss of every step.

    torch's generator and the DTensor random stream are seeded from ``cfg.seed`` first, alike on
    every rank (torch 2.13 seeds a new process's generator at random), so dropout draws are a
    function of the seed; ``--resume`` then restores both from the checkpoint.

    ``report``, if given, is a dict that receives this rank's state bytes after the last step.
    """
    torch.manual_seed(cfg.seed)  # before building: model construction draws too (nn.Linear's default init)
    hp.manual_seed(cfg.seed)
    if getattr(args, "pp", 1) > 1:  # --- pipeline parallelism: the loop in examples/llama/pipeline.py
        from examples.llama.pipeline import train_pipeline
        losses, stages, opt = train_pipeline(args, steps, cfg, mesh, log=log)
        if report is not None:
            report["bytes"] = state_bytes(stages, opt)
        return losses
    names = mesh.mesh_dim_names
    if "ep" in names:  # --- MoE expert parallelism: the batch is split over efsdp x ep
        dp = mesh.size("efsdp") * mesh.size("ep")
        dp_rank = mesh.get_local_rank("efsdp") * mesh.size("ep") + mesh.get_local_rank("ep")
    elif "dp_shard" in names:
        dp = mesh.size("dp") * mesh.size("dp_shard")
        dp_rank = mesh.get_local_rank("dp") * mesh.size("dp_shard") + mesh.get_local_rank("dp_shard")
    else:
        dp, dp_rank = mesh.size(0), mesh.get_local_rank(0)
    model = build_model(cfg.model, cfg.seed)
    # every rank built identical weights, so each slices its own shard: no communication
    parallelize_llama(model, mesh, sequence_parallel=args.sp, loss_parallel=args.loss_parallel,
                      src_data_rank=None, expert_tensor_parallel=getattr(args, "expert_tp", False),
                      cp_method=getattr(args, "cp_method", "ring"))
    # --- CP: this rank's rotary tables; batches and the loss are cp-sharded below (no-op without cp)
    from examples.llama.context_parallel import CPInputs
    cpi = CPInputs(model, mesh, cfg.seq_len)
    # --- end CP
    if getattr(args, "compile", None):
        if cpi.cp > 1:  # --- CP: whole blocks, the CP attention one opaque op (see compile_blocks_cp)
            from examples.llama.context_parallel import compile_blocks_cp
            compile_blocks_cp(model, args.compile)
        else:
            compile_blocks(model, args.compile)
    opt = build_optimizer(model.parameters(), cfg.optim)
    ckpt_dir = getattr(args, "checkpoint_dir", None)
    start = 0
    if ckpt_dir and getattr(args, "resume", False):
        from examples.llama import checkpoint
        start = checkpoint.resume(ckpt_dir, model, opt, data_seed=cfg.seed)
        log(None, steps, f"resumed from {checkpoint.latest_dir(ckpt_dir) or '(none)'} after step {start}", 0)
    data = TokenBatches(seed=cfg.seed)
    tp = mesh.size("tp") if "tp" in names else 1
    # --- MoE: expert-bias all_reduce group; a gradient clip that spans the experts' and the dense mesh
    moe = cfg.model.moe is not None
    if moe:
        from examples.llama.moe import format_load, update_expert_bias
        from examples.llama.parallelize import clip_grad_norm_, dp_group_of
        bias_group = dp_group_of(mesh)
    losses = []
    t0 = time.perf_counter()
    tokens = 0
    for step in range(start, steps):
        x, y = data.get_batch(step, cfg.global_batch, cfg.seq_len)
        x, y = dp_shard(x, dp_rank, dp), dp_shard(y, dp_rank, dp)
        x, y = cpi.shard(x, y)  # --- CP
        opt.zero_grad(set_to_none=True)
        g = train_loss(model, x, y, cpi.loss_fn(loss_fn), loss_parallel=args.loss_parallel).clone()
        _test_kill_hook(step + 1)  # tests only: HP_TEST_KILL_AT_STEP (see below)
        if moe:  # --- MoE: clip over both meshes, then the aux-loss-free bias step from global counts
            clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
            opt.step()
            load = update_expert_bias(model, bias_group)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
            opt.step()
        if dp > 1 or cpi.cp > 1:  # every tp rank holds the same loss: average over the whole world (--- CP: x cp)
            dist.all_reduce(g)
            g /= dp * tp * cpi.cp
        losses.append(g.item())
        tokens += cfg.global_batch * cfg.seq_len
        log(step, steps, losses[-1], tokens / (time.perf_counter() - t0))
        if moe:
            log(None, steps, f"  step {step + 1} {format_load(load)}", 0)
        every = getattr(args, "save_every", 0)
        if ckpt_dir and ((every and (step + 1) % every == 0) or step + 1 == steps):
            from examples.llama import checkpoint
            path = checkpoint.save(ckpt_dir, step + 1, model, opt, data_seed=cfg.seed)
            log(None, steps, f"saved {path}", 0)
    if report is not None:
        report["bytes"] = state_bytes(model, opt)
    return losses


# ---- fault injection for tests/distributed/test_elastic_restart.py (elastic restart) -------------------------
def _test_kill_hook(step):
    """``HP_TEST_KILL_AT_STEP=RANK:STEP``: that rank SIGKILLs itself in step STEP (1-based, after
    forward and backward, before the optimizer step), only in torchrun's first attempt
    (``TORCHELASTIC_RESTART_COUNT`` 0 or unset), so the restarted group runs through."""
    spec = os.environ.get("HP_TEST_KILL_AT_STEP")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != 0:
        return
    rank, at = (int(v) for v in spec.split(":"))
    if step == at and dist.get_rank() == rank:
        import signal
        print(f"HP_TEST_KILL_AT_STEP: rank {rank} kills itself in step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
# ------------------------------------------------------------------------------------------------


def compile_blocks(model, backend="inductor"):
    """``torch.compile`` each transformer block separately, as torchtitan does (one graph per block,
    no graph breaks: ``fullgraph=True``); embeddings, final norm, output and loss stay eager. In an MoE
    block only the attention is compiled (in place): the MoE layer's token counts are data-dependent.
    ``dynamic=False``: DTensor layouts are compile-time constants, shapes must be too."""
    for name, block in list(model.layers.items()):
        if hasattr(block, "moe"):  # --- MoE: token counts per expert are data-dependent: compile the attention
            block.attention.compile(backend=backend, fullgraph=True, dynamic=False)  # in place: FQNs unchanged
            continue
        model.layers.register_module(name, torch.compile(block, backend=backend, fullgraph=True, dynamic=False))
    return model


def progress(step, steps, loss, tok_s, width=30, note=""):
    if step is None:  # a message (checkpoint saved / resumed)
        print(loss, flush=True)
        return
    done = int(width * (step + 1) / steps)
    line = f"[{'#' * done}{'.' * (width - done)}] step {step + 1}/{steps}  loss {loss:.4f}  {tok_s:,.0f} tok/s"
    line += f"  {note}" if note else ""  # e.g. the pipeline's measured bubble
    end = "\n" if step + 1 == steps or not sys.stdout.isatty() else ""
    if sys.stdout.isatty():
        print("\r" + line, end=end, flush=True)
    elif (step + 1) % 5 == 0 or step == 0 or step + 1 == steps:
        print(line, flush=True)


def main(argv=None):
    args = parse_args(argv)
    if (args.resume or args.save_every) and not args.checkpoint_dir:
        raise SystemExit("--resume and --save-every need --checkpoint-dir DIR")
    if args.save_every < 0:
        raise SystemExit(f"--save-every must be >= 0, got {args.save_every}")
    if not 0.0 <= args.dropout < 1.0:
        raise SystemExit(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.dropout and args.cp > 1:  # --- CP: the context-parallel attention has no dropout
        raise SystemExit(f"--dropout {args.dropout} with --cp {args.cp} is not supported (context-parallel "
                         "attention has no dropout)")
    if args.ft_replica_group_id is not None:  # --- one torchft replica group (examples/llama/fault_tolerant.py)
        from examples.llama.fault_tolerant import main_ft
        return main_ft(args)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.plan == "auto":  # --- auto-parallel: the plan sets --dp/--dp-shard/--tp/--sp/--pp*/--cp*/--ep
        from examples.llama.auto_plan import choose
        choose(args, get_config(args.config), world)
    need = args.dp * args.dp_shard * args.tp * args.pp * args.cp  # --- CP: x cp
    if args.cp < 1:  # --- CP
        raise SystemExit(f"--cp must be >= 1, got {args.cp}")
    if args.cp > 1 and args.ep > 1:  # --- CP: composes with --tp, --dp-shard, --dp (--- CP x PP: and --pp)
        raise SystemExit(f"--cp {args.cp} with --ep {args.ep} is not supported yet; --cp composes with --tp, "
                         "--dp-shard, --dp and --pp")
    if args.ep < 1:  # --- MoE expert parallelism: checked before any process group exists
        raise SystemExit(f"--ep must be >= 1, got {args.ep}")
    if args.expert_tp and (args.ep < 2 or args.tp < 2):
        raise SystemExit(f"--expert-tp shards experts over (ep, tp): it needs --ep > 1 and --tp > 1 "
                         f"(got --ep {args.ep} --tp {args.tp})")
    if args.ep > 1 and args.pp > 1 and args.tp > 1:  # --- MoE x pipeline: ep x pp (x efsdp) tested, not x tp
        raise SystemExit(f"--ep {args.ep} with --pp {args.pp} composes with --dp-shard only; --tp {args.tp} is not "
                         "supported with both (use --ep with --dp-shard/--tp, or --pp with --tp)")
    if args.ep > 1:
        n_exp = get_config(args.config).model.moe
        if n_exp is None:
            raise SystemExit(f"--ep needs an MoE config (moe-tiny, moe-demo), got --config {args.config}")
        if args.dp > 1 or args.dp_shard % args.ep:
            raise SystemExit(f"--ep {args.ep} borrows ranks from --dp-shard (got {args.dp_shard}), which it must "
                             f"divide; --dp (HSDP) is not supported with --ep (got --dp {args.dp})")
        if n_exp.num_experts % args.ep:
            raise SystemExit(f"--ep {args.ep} must divide the {n_exp.num_experts} experts of --config {args.config}")
    if need != world:
        raise SystemExit(f"--dp {args.dp} x --dp-shard {args.dp_shard} x --tp {args.tp} x --pp {args.pp} x --cp {args.cp} = {need} "
                         "must equal the "
                         f"number of processes ({world}); launch with torchrun --nproc_per_node {need}")
    if world == 1 and "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29512", RANK="0", WORLD_SIZE="1")
    if args.pp > 1:  # --- pipeline parallelism: flag checks on every rank before any collective
        from examples.llama import pipeline
        pipeline.check_args(args, get_config(args.config), world)
    mesh = make_mesh(args)
    node_msg = node_placement(mesh)  # multi-node launches: which node holds each rank (collective)
    cfg = get_config(args.config)
    if args.dropout:
        from dataclasses import replace
        cfg.model = replace(cfg.model, dropout=args.dropout)
    steps = args.steps or cfg.steps
    rank = dist.get_rank()
    if rank == 0:
        n = sum(p.numel() for p in build_model(cfg.model, cfg.seed).parameters())
        lp = ", loss_parallel" if args.loss_parallel else ""
        lp += f", compiled blocks ({args.compile})" if args.compile else ""
        lp += f", dropout {args.dropout}" if args.dropout else ""
        ds = f" dp_shard={args.dp_shard}" if args.dp_shard > 1 else ""
        ds += pipeline.describe(args, cfg) if args.pp > 1 else ""
        ds += f" ep={args.ep}" if args.ep > 1 else ""
        from examples.llama.context_parallel import describe  # --- CP
        ds += describe(args.cp_method, mesh)
        print(f"hyper_parallel demo: {args.config} Llama ({n:,} params), dp={args.dp}{ds} tp={args.tp} "
              f"sp={'on' if args.sp else 'off'}{lp}, {steps} steps, global batch {cfg.global_batch}x{cfg.seq_len}")
        if node_msg:
            print(node_msg, flush=True)
    t0 = time.perf_counter()
    report = {}
    losses = train(args, steps, cfg, mesh, log=progress if rank == 0 else (lambda *a, **k: None), report=report)
    elapsed = time.perf_counter() - t0
    per_rank = torch.zeros(world, dtype=torch.long)
    per_rank[rank] = report["bytes"]
    dist.all_reduce(per_rank)
    if rank == 0:
        from examples.llama.plot import save_loss_curves
        n = sum(p.numel() for p in build_model(cfg.model, cfg.seed).parameters())
        total = 4 * n * 4  # fp32 parameter + gradient + AdamW exp_avg + exp_avg_sq
        print("per-rank parameter+gradient+optimizer bytes: "
              + ", ".join(f"rank {r}: {b:,}" for r, b in enumerate(per_rank.tolist()))
              + f" (unsharded total {total:,})")
        ds = f"_dpshard{args.dp_shard}" if args.dp_shard > 1 else ""
        ds = f"_pp{args.pp}{args.pp_schedule}" + ds if args.pp > 1 else ds
        ds += f"_ep{args.ep}" if args.ep > 1 else ""
        ds += f"_cp{args.cp}{args.cp_method}" if args.cp > 1 else ""  # --- CP
        series = {f"dp{args.dp}{ds}_tp{args.tp}{'_sp' if args.sp else ''}": losses}
        done = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "nothing left to train"
        print(f"trained {len(losses)} steps in {elapsed:.1f}s; {done}")
        if args.dropout and not args.no_compare:
            print("single-process comparison skipped: with --dropout the masks depend on the layout")
        elif not args.no_compare and losses:
            print("running the same training in one process for comparison ...", flush=True)
            ref, _ = train_reference(cfg.model, steps, seed=cfg.seed, global_batch=cfg.global_batch,
                                     seq_len=cfg.seq_len, optim=cfg.optim)
            ref = ref[len(ref) - len(losses):]  # after --resume only the last steps ran here
            series["single_process"] = ref
            diff = max(abs(a - b) for a, b in zip(losses, ref))
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
            print(f"largest loss difference vs single process: {diff:.2e} (relative {rel:.2e})")
        paths = save_loss_curves(args.out, series, title="example Llama training loss")
        print("loss curve written to " + ", ".join(str(p) for p in paths))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
