"""Pipeline parallelism for the example trainer (``train.py --pp N``), torchtitan's recipe on hyper_parallel.

    torchrun --nproc_per_node 4 examples/llama/train.py --pp 2 --tp 2 --sp --pp-schedule 1f1b
    torchrun --nproc_per_node 4 examples/llama/train.py --pp 2 --dp-shard 2 --pp-microbatches 4
    torchrun --nproc_per_node 2 examples/llama/train.py --pp 2 --pp-schedule zbv

One root mesh ``("pp", "dp_shard", "tp")``; every rank builds the whole model (same seed), then:

1. ``hyper_parallel.pipelining.split_into_stages`` keeps this rank's stages (one for GPipe/1F1B,
   looped for Interleaved1F1B, V-shaped for ZBV/DualPipeV), every parameter under its unsplit
   name;
2. ``parallelize_llama`` applies TP (+SP) on ``mesh["tp"]`` and ``fully_shard`` per block + root
   on ``mesh["dp_shard"]`` to each stage, as to a whole model (with SP the boundary hidden state
   is a ``Shard(1)`` DTensor);
3. a ``PipelineStage`` per local stage and the schedule run the microbatches; gradients are
   clipped with ``hyper_parallel.pipelining.clip_grad_norm_`` (norm over every stage, all ranks),
   then AdamW steps.

MoE configs with ``--ep M`` (``--pp 2 --dp-shard 2 --ep 2``): the root mesh is ``("pp", "efsdp", "ep", "tp")``
(``parallelize.make_moe_mesh``), step 2 applies the EP layout to each stage, and after ``opt.step()``
:meth:`Pipeline.moe_step` runs the expert-bias step of the stage's MoE layers from their counts summed
over all microbatches and the stage's data-parallel ranks (docs/moe_example.md).

Checkpoints: a rank's stages are presented to ``examples/llama/checkpoint.py`` as one module whose
parameter names are the whole model's (:func:`stages_module`), so a checkpoint saved at one
``--pp`` resumes at any other, or without pipelining.

Bubble: :class:`BubbleMeter` times each step on each rank and the time spent inside the stages'
forward / backward / weight-gradient computations and the loss (the schedule calls
``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk`` and
``_maybe_compute_loss``); ``bubble = 1 - busy / step`` is the share of the step the rank spent
elsewhere: waiting for point-to-point receives (and sends), and the schedule's bookkeeping.
Collectives inside a stage (TP, FSDP) count as busy. The progress line shows the mean over the
ranks and their range.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import pipelining as pp
from examples.llama.data import TokenBatches, dp_shard
from examples.llama.model import build_model, loss_fn
from examples.llama.parallelize import parallelize_llama
from examples.llama.reference import build_optimizer

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble",
             "dualpipev": "DualPipeV"}


def add_pp_args(p):
    """The ``--pp*`` flags (one argparse group)."""
    g = p.add_argument_group("pipeline parallelism (examples/llama/pipeline.py)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (ranks along the pipeline)")
    g.add_argument("--pp-schedule", default="1f1b", choices=sorted(SCHEDULES), help="pipeline schedule")
    g.add_argument("--pp-microbatches", type=int, default=None,
                   help="microbatches per step (default: the number of stages)")
    g.add_argument("--pp-layers-per-stage", type=int, default=None, metavar="K",
                   help="layers per stage (embedding and output head count as one each); default: 1 stage per "
                        "rank (2 for interleaved1f1b, zbv, dualpipev)")
    return g


def num_stages(args, cfg) -> int:
    """Total stages: one per rank (two for looped and V schedules), or from --pp-layers-per-stage."""
    _, per_rank = _kind(args)
    n = None if args.pp_layers_per_stage else args.pp * (per_rank or 2)
    return len(pp.plan_stages([str(i) for i in range(cfg.model.n_layers)], n, args.pp_layers_per_stage))


def _kind(args):
    """("single", 1), ("v", 2) or ("looped", None): the schedule's stage-to-rank map and stages per rank."""
    cls = pp.get_schedule_class(SCHEDULES[args.pp_schedule])
    if issubclass(cls, (pp.ScheduleZBVZeroBubble, pp.ScheduleDualPipeV)):
        return "v", 2
    return ("single", 1) if issubclass(cls, pp.PipelineScheduleSingle) else ("looped", None)


def check_args(args, cfg, world):
    """Errors on every rank (before any collective) for flags that cannot make a pipeline."""
    if args.pp < 1:
        raise SystemExit(f"--pp must be >= 1, got {args.pp}")
    if args.dp != 1:
        raise SystemExit(f"--pp {args.pp} composes with --dp-shard and --tp (mesh pp x dp_shard x tp); "
                         f"--dp {args.dp} (replication) is not supported with it")
    if args.loss_parallel:
        raise SystemExit("--loss-parallel is not supported with --pp (the schedule's loss_fn takes the logits)")
    s = num_stages(args, cfg)
    kind, per_rank = _kind(args)
    if kind == "single" and s != args.pp:
        raise SystemExit(f"--pp-schedule {args.pp_schedule} runs one stage per rank: --pp-layers-per-stage "
                         f"{args.pp_layers_per_stage} makes {s} stages for --pp {args.pp}")
    if kind == "v" and s != 2 * args.pp:
        raise SystemExit(f"--pp-schedule {args.pp_schedule} needs exactly 2 stages per rank: "
                         f"--pp-layers-per-stage {args.pp_layers_per_stage} makes {s} stages for --pp {args.pp}")
    if kind == "looped" and s % args.pp:
        raise SystemExit(f"--pp-schedule {args.pp_schedule}: {s} stages do not divide over --pp {args.pp}")
    m = args.pp_microbatches if args.pp_microbatches is not None else s
    if m < 1:
        raise SystemExit(f"--pp-microbatches must be >= 1, got {m}")
    local = cfg.global_batch // args.dp_shard
    if cfg.global_batch % args.dp_shard or local % m:
        raise SystemExit(f"--pp-microbatches {m}: the batch per data-parallel rank ({cfg.global_batch} / "
                         f"--dp-shard {args.dp_shard}) must split into {m} equal microbatches")
    if kind == "v" and (args.dp_shard > 1 or getattr(args, "ep", 1) > 1):
        # the zero-bubble weight pass (torch.autograd.grad) bypasses fully_shard's reduce-scatter
        raise SystemExit(f"--pp-schedule {args.pp_schedule} does not compose with --dp-shard {args.dp_shard}"
                         + (f" / --ep {args.ep}" if getattr(args, "ep", 1) > 1 else "")
                         + " (its separate weight-gradient pass bypasses fully_shard's reduce-scatter); "
                         "use gpipe, 1f1b or interleaved1f1b")
    # --- CP x PP: ContextParallel on each stage's attention, cp-sharded microbatches (context_parallel.py)
    cp = getattr(args, "cp", 1)
    if cp > 1:
        if kind == "v":
            raise SystemExit(f"--cp {cp} with --pp-schedule {args.pp_schedule}: its separate weight-gradient pass "
                             "bypasses the gradient reduction over cp; use gpipe, 1f1b or interleaved1f1b")
        if args.cp_method != "ring":
            raise SystemExit(f"--cp {cp} with --pp {args.pp} is tested with --cp-method ring only, got "
                             f"--cp-method {args.cp_method}")
        if args.tp > 1 or args.sp:
            raise SystemExit(f"--cp {cp} with --pp {args.pp} composes with --dp-shard; --tp {args.tp}"
                             f"{' --sp' if args.sp else ''} is not supported with both")
        if args.compile:
            raise SystemExit(f"--compile is not supported with --cp {cp} and --pp {args.pp} (the stages compile "
                             "whole blocks; the CP attention stays eager: docs/context_parallel.md)")
        if cfg.seq_len < 2 * cp:
            raise SystemExit(f"--cp {cp}: seq_len {cfg.seq_len} of --config {args.config} must be >= 2 x cp "
                             "(load-balanced head-tail shards)")
    # --- end CP x PP
    if args.compile and kind == "v":
        raise SystemExit(f"--compile: torch's zero-bubble schedule {args.pp_schedule} refuses compiled stages")
    return s, m


def make_mesh(args):
    """The root mesh ("pp", "dp_shard", "tp"); with --ep ("pp", "efsdp", "ep", "tp"), "dp_shard" its flattened
    efsdp x ep (examples/llama/parallelize.make_moe_mesh)."""
    if getattr(args, "ep", 1) > 1:  # --- MoE expert parallelism inside each stage
        from examples.llama.parallelize import make_moe_mesh
        return make_moe_mesh("cpu", args.dp_shard, args.ep, args.tp, pp=args.pp)
    if getattr(args, "cp", 1) > 1:  # --- CP x PP: ("pp", "dp_shard", "cp", "tp")
        return hp.init_device_mesh("cpu", (args.pp, args.dp_shard, args.cp, args.tp),
                                   mesh_dim_names=("pp", "dp_shard", "cp", "tp"))
    return hp.init_device_mesh("cpu", (args.pp, args.dp_shard, args.tp), mesh_dim_names=("pp", "dp_shard", "tp"))


class _StagesModule(torch.nn.Module):
    """Several stages of one rank as one module with the whole model's parameter names (for checkpoints)."""

    def __init__(self, modules):
        super().__init__()
        layers = {}
        for m in modules:
            for name in ("tok_embeddings", "norm", "output"):
                if getattr(m, name, None) is not None:
                    setattr(self, name, getattr(m, name))
            layers.update(m.layers.items())
        self.layers = torch.nn.ModuleDict(dict(sorted(layers.items(), key=lambda kv: int(kv[0]))))


def stages_module(modules):
    """One module for this rank's stage modules: the stage itself when there is one (its parameter names are
    the whole model's), else a view holding all of them under the same names."""
    return modules[0] if len(modules) == 1 else _StagesModule(modules)


class BubbleMeter:
    """Per-rank busy time inside the stages' computations, and the bubble fraction of each step."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stages, schedule=None):
        self.busy = 0.0
        self._depth = 0
        for st in stages:
            for name in self.METHODS:
                self._wrap(st, name)
        if schedule is not None and hasattr(schedule, "_maybe_compute_loss"):
            self._wrap(schedule, "_maybe_compute_loss")

    def _wrap(self, obj, name):
        fn = getattr(obj, name)

        def timed(*a, **k):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.busy += time.perf_counter() - t0
        setattr(obj, name, timed)

    def measure(self, fn):
        """Run ``fn()``; returns (its result, step seconds, bubble fraction)."""
        self.busy = 0.0
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        return out, dt, max(0.0, 1.0 - self.busy / dt) if dt > 0 else 0.0


def _zero_counts_after(stage, name, layers):
    """--- MoE: wrap ``stage.<name>`` so that the MoE layers' token counts are zeroed after it ran."""
    fn = getattr(stage, name)

    def wrapped(*a, **k):
        try:
            return fn(*a, **k)
        finally:
            for layer in layers:
                layer.tokens_per_expert.zero_()
    setattr(stage, name, wrapped)


class Pipeline:
    """This rank's stages, schedule and optimizer over one root mesh ("pp", "dp_shard", "tp")."""

    def __init__(self, args, cfg, mesh, *, microbatches=None, model=None):
        from examples.llama.context_parallel import CPInputs  # --- CP x PP
        self.mesh = mesh
        self.schedule_name = SCHEDULES[args.pp_schedule]
        pp_mesh = mesh["pp"]
        model = model if model is not None else build_model(cfg.model, cfg.seed)
        kind, per_rank = _kind(args)
        n = None if args.pp_layers_per_stage else args.pp * (per_rank or 2)
        parts = pp.split_into_stages(model, pp_mesh, num_stages=n, layers_per_stage=args.pp_layers_per_stage,
                                     schedule=self.schedule_name)
        self.num_stages = len(pp.plan_stages(list(model.layers.keys()), n, args.pp_layers_per_stage))
        for _, m in parts:  # torchtitan's order: split, TP (+SP) per stage, fully_shard per block + stage root
            parallelize_llama(m, mesh, sequence_parallel=args.sp, src_data_rank=None,
                              expert_tensor_parallel=getattr(args, "expert_tp", False),
                              cp_method=getattr(args, "cp_method", "ring"))
            # --- CP x PP: this stage's rotary tables cut to the rank's head-tail positions (no-op without cp)
            self.cpi = CPInputs(m, mesh, cfg.seq_len)
            if getattr(args, "compile", None):
                for block in m.layers.values():
                    # the block's forward, not the module call: the SP stage-boundary hooks on a stage's first /
                    # last block (parallelize_llama) stay eager; traced inside the compiled call, the output
                    # hook's DTensor left stage 0 without a gradient path (a wrong loss from step 2)
                    block.forward = torch.compile(block.forward, backend=args.compile, fullgraph=True,
                                                  dynamic=False)
        self.parts = parts
        self.modules = [m for _, m in parts]
        self.module = stages_module(self.modules)
        dev = torch.device("cpu")
        self.stages = [pp.PipelineStage(m, s, self.num_stages, dev, group=pp_mesh.get_group()) for s, m in parts]
        self.microbatches = microbatches or args.pp_microbatches or self.num_stages
        cls = pp.get_schedule_class(self.schedule_name)
        self.schedule = cls(self.stages[0] if kind == "single" else self.stages, n_microbatches=self.microbatches,
                            loss_fn=self.cpi.loss_fn(loss_fn))  # --- CP x PP: cp * local sum / N per microbatch
        self.has_first = any(s == 0 for s, _ in parts)
        self.has_last = any(s == self.num_stages - 1 for s, _ in parts)
        self.params = [p for m in self.modules for p in m.parameters()]
        self.meter = BubbleMeter(self.stages, self.schedule)
        # --- MoE (--ep): every MoE layer lives on one stage; the expert-bias step sums its counts (accumulated
        # over all microbatches of the step) over the stage's data-parallel ranks (efsdp x ep, or dp_shard)
        from examples.llama.moe import moe_layers
        self.moe = [(n, m.args.num_experts) for n, m in moe_layers(model)]
        self.last_load = {}
        for st, m in zip(self.stages, self.modules):  # torch's first-step metadata inference runs each stage's
            if moe_layers(m):                         # module once more (on empty tensors): not a step's tokens
                _zero_counts_after(st, "_forward_metadata_inference", [layer for _, layer in moe_layers(m)])

    def moe_step(self):
        """After ``opt.step()``: the aux-loss-free bias step of this rank's MoE layers from their global counts
        (one all_reduce over the stage's data-parallel ranks), then every MoE layer's global counts gathered
        on every rank (one all_reduce over pp: each layer is held by exactly one pipeline rank)."""
        from examples.llama.moe import update_expert_bias
        from examples.llama.parallelize import dp_group_of
        if not self.moe:
            return {}
        mine = update_expert_bias(self.module, dp_group_of(self.mesh))
        flat = torch.cat([mine[n].double() if n in mine else torch.zeros(e, dtype=torch.float64)
                          for n, e in self.moe])
        dist.all_reduce(flat, group=self.mesh["pp"].get_group())
        return dict(zip([n for n, _ in self.moe], flat.split([e for _, e in self.moe])))

    def step(self, x, y):
        """One pipelined forward + backward of this rank's share; returns (this rank's loss or None, seconds,
        bubble fraction)."""
        losses = [] if self.has_last else None
        _, dt, bubble = self.meter.measure(lambda: self.schedule.step(
            *((x,) if self.has_first else ()), target=y if self.has_last else None, losses=losses))
        if not self.has_last:
            return None, dt, bubble
        vals = [l.full_tensor() if isinstance(l, hp.DTensor) else l for l in losses]
        return torch.stack([v.detach() for v in vals]).mean(), dt, bubble


    def train_step(self, opt, x, y, max_grad_norm):
        """zero_grad, the pipelined step, ``clip_grad_norm_`` over all stages, ``opt.step()``. ``x``/``y``: this
        rank's data-parallel share. Returns (the global mean loss, every rank's bubble fraction as a tensor)."""
        opt.zero_grad(set_to_none=True)
        loss, _, bubble = self.step(x, y)
        pp.clip_grad_norm_(self.params, max_grad_norm, pp_group=self.mesh["pp"])
        opt.step()
        self.last_load = self.moe_step()  # --- MoE: expert-bias step and global expert load
        # one all_reduce: the loss (held by the dp x tp ranks of the last stage) and every rank's bubble
        world = dist.get_world_size()
        stats = torch.zeros(1 + world, dtype=torch.float64)
        stats[0] = float(loss) if loss is not None else 0.0
        stats[1 + dist.get_rank()] = bubble
        dist.all_reduce(stats)
        # --- CP x PP: the last stage's cp ranks hold cp-scaled losses whose mean is the unsharded mean
        return stats[0].item() / (self.mesh["dp_shard"].size() * self.mesh.size("tp") * self.cpi.cp), stats[1:]


def train_pipeline(args, steps, cfg, mesh, log=print, *, model=None):
    """The ``train.py`` loop with a pipeline; returns (global mean loss of every step, the rank's stages as one
    module, optimizer). ``model``: the whole model to split (default ``build_model(cfg.model, cfg.seed)``)."""
    from examples.llama import checkpoint
    pipe = Pipeline(args, cfg, mesh, model=model)
    opt = build_optimizer(pipe.params, cfg.optim)
    dp, dp_rank = mesh["dp_shard"].size(), mesh["dp_shard"].get_local_rank()  # (with --ep: efsdp x ep flattened)
    ckpt_dir = getattr(args, "checkpoint_dir", None)
    start = 0
    if ckpt_dir and getattr(args, "resume", False):
        start = checkpoint.resume(ckpt_dir, pipe.module, opt, stage=True)
        log(None, steps, f"resumed from {checkpoint.latest_dir(ckpt_dir) or '(none)'} after step {start}", 0)
    data = TokenBatches(seed=cfg.seed)
    losses, tokens, t0 = [], 0, time.perf_counter()
    for step in range(start, steps):
        x, y = data.get_batch(step, cfg.global_batch, cfg.seq_len)
        x, y = dp_shard(x, dp_rank, dp), dp_shard(y, dp_rank, dp)
        x, y = pipe.cpi.shard(x, y)  # --- CP x PP: head-tail sequence shards (first stage's input, last's labels)
        loss, b = pipe.train_step(opt, x, y, cfg.optim.max_grad_norm)
        losses.append(loss)
        tokens += cfg.global_batch * cfg.seq_len
        log(step, steps, losses[-1], tokens / (time.perf_counter() - t0),
            note=f"bubble {b.mean().item():.0%} (ranks {b.min().item():.0%}-{b.max().item():.0%})")
        if pipe.last_load:  # --- MoE: every layer's global expert load
            from examples.llama.moe import format_load
            log(None, steps, f"  step {step + 1} {format_load(pipe.last_load)}", 0)
        every = getattr(args, "save_every", 0)
        if ckpt_dir and ((every and (step + 1) % every == 0) or step + 1 == steps):
            path = checkpoint.save(ckpt_dir, step + 1, pipe.module, opt)
            log(None, steps, f"saved {path}", 0)
    return losses, pipe.module, opt


def describe(args, cfg) -> str:
    """The pipeline part of train.py's header line."""
    s = num_stages(args, cfg)
    m = args.pp_microbatches or s
    return f" pp={args.pp} ({SCHEDULES[args.pp_schedule]}, {s} stages, {m} microbatches)"
