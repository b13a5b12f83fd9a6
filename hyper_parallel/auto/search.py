"""``plan()``: enumerate layouts, reject the invalid ones with a reason, score the rest, best first."""
from __future__ import annotations

import copy
import functools
import itertools
import time
import weakref
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from hyper_parallel.auto.cluster import MAX_MFU, Cluster
from hyper_parallel.auto.cost import SCHEDULES, STAGES_PER_RANK, Candidate, evaluate, state_floor, summarize
from hyper_parallel.auto.model_stats import trace_model
from hyper_parallel.auto.plan import GiB, Plan
from hyper_parallel.auto.roles import infer_roles

PARALLELISMS = ("dp", "fsdp", "tp", "sp", "pp", "cp", "ep")
AC_CHOICES = ("none", "full", "selective")
_LAST_REJECTIONS: List[Tuple[str, str]] = []


def _divisors(number: int) -> List[int]:
    return [k for k in range(1, number + 1) if number % k == 0]


def explain_rejections(limit: Optional[int] = None) -> str:
    """Why each candidate of the last ``plan()`` call was excluded (one line per candidate)."""
    rows = _LAST_REJECTIONS if limit is None else _LAST_REJECTIONS[:limit]
    out = [f"{len(_LAST_REJECTIONS)} candidates rejected"] + [f"  {name}: {why}" for name, why in rows]
    if limit is not None and len(_LAST_REJECTIONS) > limit:
        out.append(f"  ... {len(_LAST_REJECTIONS) - limit} more")
    return "\n".join(out)


def _name(degrees, sequence_parallel=False, activation_checkpointing="none", schedule=None, microbatches=None,
          cp_method=None):
    s = " x ".join(f"{k}{degrees[k]}" for k in ("dp", "fsdp", "tp", "pp", "cp", "ep") if degrees[k] > 1) or "single"
    if sequence_parallel:
        s += " +sp"
    if schedule:
        s += f" {schedule}/m{microbatches}"
    if cp_method:
        s += f" cp:{cp_method}"
    if activation_checkpointing != "none":
        s += f" ac:{activation_checkpointing}"
    return s


def _dtype_item(dtype, default):
    if dtype is None:
        return default
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def plan(model, cluster: Cluster, *, global_batch: int, seq_len: int, optimizer: str = "adamw",
         param_dtype=None, reduce_dtype=None, parallelisms: Sequence[str] = PARALLELISMS,
         activation_checkpointing: str = "auto", top_k: int = 5, roles: Optional[Dict[str, str]] = None,
         example_input=None, loss=None) -> List[Plan]:
    """The ``top_k`` best layouts of ``model`` (an ``nn.Module``, meta device allowed) on ``cluster``,
    best (shortest predicted step time among those that fit the per-rank memory) first.

    ``parallelisms``: which of dp (replicate), fsdp, tp, sp, pp, cp, ep may be used.
    ``activation_checkpointing``: "auto" (search none / full (per block) / selective (op-level: matmul and
    attention outputs saved)), or one of "none", "full", "selective".
    ``roles``: ``{module fqn: role}`` for modules the planner cannot tag (see ``hyper_parallel.auto.roles``).
    Raises ``ValueError`` when nothing fits (naming the smallest per-rank memory needed, in GiB, and the
    plan closest to fitting) or when the constraints leave no valid layout (saying why).
    """
    global _LAST_REJECTIONS
    if not isinstance(cluster, Cluster):
        raise TypeError(f"plan(): cluster must be a hyper_parallel.auto.Cluster, got {type(cluster).__name__}")
    for name, v in (("global_batch", global_batch), ("seq_len", seq_len), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"plan(): {name} must be a positive int, got {v!r}")
    bad = [p for p in parallelisms if p not in PARALLELISMS]
    if bad:
        raise ValueError(f"plan(): parallelisms={tuple(parallelisms)!r} has unknown {bad}; choose from {PARALLELISMS}")
    if optimizer not in ("adamw", "adam", "sgd"):
        raise ValueError(f"plan(): optimizer={optimizer!r}; supported: 'adamw', 'adam', 'sgd'")
    acs = AC_CHOICES if activation_checkpointing == "auto" else (activation_checkpointing,)
    if acs[0] not in AC_CHOICES:
        raise ValueError(f"plan(): activation_checkpointing={activation_checkpointing!r}; expected 'auto' or one "
                         f"of {AC_CHOICES}")
    info, ms = _analyse(model, seq_len, example_input, loss, roles)
    item = ms.act_item
    p_item = _dtype_item(param_dtype, item)
    r_item = _dtype_item(reduce_dtype, p_item)
    W = cluster.world_size
    allowed = set(parallelisms)
    scoring = copy.copy(cluster)  # the same cluster, its collective times memoised for this search
    scoring.collective_time = functools.lru_cache(maxsize=None)(cluster.collective_time)
    scoring._cost_memo = {}  # sub-results candidates of this search share (cost.evaluate, cost._fsdp_time)
    rejections: List[Tuple[str, str]] = []
    scored: List[Plan] = []
    E = info.num_experts
    L = ms.n_layers
    divs = _divisors(W)
    for prune in (True, False):  # again without pruning only when nothing fits (to name the closest plan)
        rejections, scored, pruned = [], [], 0
        for tp, pp, cp in itertools.product(divs, divs, divs):
            if W % (tp * pp * cp):
                continue
            rest = W // (tp * pp * cp)
            for fsdp in _divisors(rest):
                dp = rest // fsdp
                for ep in (_divisors(fsdp) if (E and "ep" in allowed) else [1]):
                    d = {"dp": dp, "fsdp": fsdp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
                    why = _check(d, info, cluster, global_batch, seq_len, allowed, L, E)
                    if why:
                        rejections.append((_name(d), why))
                        continue
                    floor = state_floor(ms, d, optimizer)
                    if prune and floor > cluster.device_memory:  # none of these degrees' variants fits: skip them
                        rejections.append((_name(d) + " (all variants)", f"parameters + gradients + optimizer alone need "
                                           f">= {floor / GiB:.2f} GiB per rank > {cluster.device_memory / GiB:.2f} GiB"))
                        pruned += 1
                        continue
                    sps = (False, True) if tp > 1 and "sp" in allowed else (False,)
                    scheds = SCHEDULES if pp > 1 else (None,)
                    cpms = ("ring", "ulysses") if cp > 1 else (None,)
                    b_local = global_batch // (dp * fsdp)
                    for sched in scheds:
                        if sched and L < pp * STAGES_PER_RANK[sched]:
                            rejections.append((_name(d, schedule=sched, microbatches="*"),
                                               f"{L} layers < {pp * STAGES_PER_RANK[sched]} stages of schedule {sched}"))
                            continue
                        mbs = sorted({k for k in (pp, 2 * pp, 4 * pp, 8 * pp, b_local)
                                      if k <= b_local and b_local % k == 0 and k >= pp}) if sched else [1]
                        if sched and not mbs:
                            rejections.append((_name(d, schedule=sched, microbatches="*"),
                                               f"the local batch {b_local} cannot be split "
                                               f"into >= pp={pp} microbatches"))
                            continue
                        if sched == "interleaved1f1b":
                            mbs = [k for k in mbs if k % pp == 0]
                        for m, sp, ac, cpm in itertools.product(mbs, sps, acs, cpms):
                            if cpm == "ulysses" and pp > 1:
                                rejections.append((_name(d, sp, ac, sched, m, cpm), "cp with pp runs the ring method only"))
                                continue
                            if cpm == "ulysses" and info.n_heads % (tp * cp):
                                rejections.append((_name(d, sp, ac, sched, m, cpm),
                                                   f"ulysses needs tp*cp={tp * cp} to divide n_heads={info.n_heads}"))
                                continue
                            c = Candidate(d, sp, ac, sched, m, cpm, STAGES_PER_RANK.get(sched, 1))
                            scored.append(_score(ms, scoring, c, global_batch, optimizer, p_item, r_item, seq_len,
                                                 param_dtype, reduce_dtype, info, scoring.device_memory))
        if not pruned or any(p.fits for p in scored):
            break
    _LAST_REJECTIONS = rejections
    if not scored:
        relevant = [f"{name}: {why}" for name, why in rejections if "is not in parallelisms" not in why]
        reasons = relevant or [f"no product of the allowed degrees equals world_size={W}"]
        raise ValueError(f"plan(): no valid layout of the model for world_size={W} under parallelisms="
                         f"{tuple(parallelisms)!r}: " + "; ".join(reasons[:6])
                         + (f" (+{len(reasons) - 6} more: explain_rejections())" if len(reasons) > 6 else ""))
    fits = [p for p in scored if p.fits]
    if not fits:
        closest = min(scored, key=lambda option: option.memory.total)
        raise ValueError(
            f"plan(): no layout fits {cluster.device_memory / GiB:.2f} GiB per rank: the smallest per-rank memory "
            f"needed is {closest.memory.total / GiB:.2f} GiB, by the plan closest to fitting: {closest.summary()} "
            f"(params {closest.memory.params / GiB:.2f} + grads {closest.memory.grads / GiB:.2f} + optimizer "
            f"{closest.memory.optimizer / GiB:.2f} + activations {closest.memory.activations / GiB:.2f} + buffers "
            f"{closest.memory.buffers / GiB:.2f} GiB). Use more devices, a smaller global_batch, or allow more "
            f"parallelisms / activation_checkpointing")
    for p in scored:
        if not p.fits:
            rejections.append((p.summary(), f"needs {p.memory.total / GiB:.2f} GiB per rank > "
                               f"{cluster.device_memory / GiB:.2f} GiB"))
    over = [p for p in fits if p.mfu > MAX_MFU] if cluster.peak_known else []
    for p in over:  # beyond what any published run reaches: the cluster's rates are wrong, not the plan right
        rejections.append((p.summary(), f"predicted {p.mfu:.0%} model-FLOPs utilisation > {MAX_MFU:.0%}: check the "
                           "cluster's kernel rates (Cluster(flops=, attention_flops=, peak_flops=) or measure())"))
    fits = [p for p in fits if all(p is not q for q in over)]
    if not fits:
        raise ValueError(f"plan(): every layout that fits is predicted above {MAX_MFU:.0%} model-FLOPs utilisation "
                         f"(e.g. {over[0].summary()}: {over[0].mfu:.0%}); the cluster's kernel rates "
                         f"(flops={cluster.flops:.3g}, peak_flops={cluster.peak_flops:.3g}) are not physical")
    fits.sort(key=lambda option: (option.step_time.total, option.memory.total))
    return fits[:top_k]


def evaluate_plan(model, cluster: Cluster, *, degrees: Dict[str, int], global_batch: int, seq_len: int,
                  sequence_parallel: bool = False, activation_checkpointing: str = "none", pp_schedule: str = None,
                  microbatches: int = None, cp_method: str = None, optimizer: str = "adamw", param_dtype=None,
                  reduce_dtype=None, roles=None, example_input=None, loss=None, stages_per_rank: int = None,
                  stage_layers=None, first_stage_layers: int = None, last_stage_layers: int = None,
                  recompute_layers: int = None) -> Plan:
    """The :class:`Plan` of one given layout (``degrees``: any of dp, fsdp, tp, pp, cp, ep; missing ones are 1),
    with its predicted memory and step time; ``ValueError`` if the layout is invalid for the model.
    ``stages_per_rank``: virtual stages per rank of ``interleaved1f1b`` (default 2); ``stage_layers``: the block
    count of every stage (default: the balanced split, ``hyper_parallel.pipelining.balanced_stage_layers``), or
    ``first_stage_layers`` / ``last_stage_layers`` (Megatron's control; the other stages balanced).
    ``recompute_layers=k`` with ``activation_checkpointing="full"``: only the first k blocks of every stage (of
    the model without pp) are checkpointed (Megatron's ``--recompute-method block --recompute-num-layers k``)."""
    d = {k: 1 for k in ("dp", "fsdp", "tp", "pp", "cp", "ep")}
    unknown = set(degrees) - set(d)
    if unknown:
        raise ValueError(f"evaluate_plan: unknown degrees {sorted(unknown)}; expected keys of {sorted(d)}")
    d.update(degrees)
    prod = d["dp"] * d["fsdp"] * d["tp"] * d["pp"] * d["cp"]
    if prod != cluster.world_size:
        raise ValueError(f"evaluate_plan: dp*fsdp*tp*pp*cp = {prod} != world_size {cluster.world_size}")
    info, ms = _analyse(model, seq_len, example_input, loss, roles)
    why = _check(d, info, cluster, global_batch, seq_len, PARALLELISMS, ms.n_layers, info.num_experts,
                 searching=False)
    if why:
        raise ValueError(f"evaluate_plan: invalid layout {_name(d)}: {why}")
    if d["pp"] > 1:
        pp_schedule = pp_schedule or "1f1b"
        microbatches = microbatches or d["pp"]
    if d["cp"] > 1:
        cp_method = cp_method or "ring"
    if stages_per_rank is not None and (d["pp"] == 1 or pp_schedule != "interleaved1f1b") and stages_per_rank != 1:
        raise ValueError(f"evaluate_plan: stages_per_rank={stages_per_rank} needs pp > 1 and pp_schedule="
                         f"'interleaved1f1b', got pp={d['pp']}, pp_schedule={pp_schedule!r}")
    v = (stages_per_rank or STAGES_PER_RANK.get(pp_schedule, 1)) if d["pp"] > 1 else 1
    if d["pp"] > 1 and ms.n_layers < d["pp"] * v:
        raise ValueError(f"evaluate_plan: {ms.n_layers} blocks < pp * stages_per_rank = {d['pp'] * v} stages")
    if first_stage_layers is not None or last_stage_layers is not None:  # Megatron-style: the rest balanced
        if stage_layers is not None or d["pp"] == 1:
            raise ValueError("evaluate_plan: first_stage_layers / last_stage_layers need pp > 1 and no stage_layers")
        from hyper_parallel.pipelining.split import balanced_stage_layers
        w, first, last = ms.weights
        stage_layers = balanced_stage_layers(w, d["pp"] * v, first_weight=first, last_weight=last,
                                             first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)
    if stage_layers is not None and (d["pp"] == 1 or len(stage_layers) != d["pp"] * v
                                     or sum(stage_layers) != ms.n_layers):
        raise ValueError(f"evaluate_plan: stage_layers={stage_layers!r} must give each of the pp * stages_per_rank = "
                         f"{d['pp'] * v} stages its block count, {ms.n_layers} in all")
    if recompute_layers is not None and (activation_checkpointing != "full" or isinstance(recompute_layers, bool)
                                         or not isinstance(recompute_layers, int) or recompute_layers < 0):
        raise ValueError(f"evaluate_plan: recompute_layers={recompute_layers!r} needs activation_checkpointing='full' "
                         f"(got {activation_checkpointing!r}) and an int >= 0")
    c = Candidate(d, bool(sequence_parallel and d["tp"] > 1), activation_checkpointing, pp_schedule if d["pp"] > 1
                  else None, microbatches or 1, cp_method if d["cp"] > 1 else None, v,
                  tuple(stage_layers) if stage_layers is not None else None, recompute_layers)
    p_item = _dtype_item(param_dtype, ms.act_item)
    return _score(ms, cluster, c, global_batch, optimizer, p_item, _dtype_item(reduce_dtype, p_item), seq_len,
                  param_dtype, reduce_dtype, info)


def _score(summary, cluster, candidate, global_batch, optimizer, p_item, r_item, seq_len, param_dtype, reduce_dtype,
           info, memory_limit=None):
    """The candidate's Plan; over ``memory_limit`` (bytes) it is only a rejection: memory, no step time (None)."""
    mem, st, lps, rows = evaluate(summary, cluster, candidate, global_batch=global_batch, optimizer=optimizer,
                                  param_item=p_item, reduce_item=r_item, memory_limit=memory_limit)
    p = _make_plan(candidate, mem, st, lps, cluster, global_batch, seq_len, param_dtype, reduce_dtype, info)
    p.stages_per_rank = candidate.stages_per_rank if candidate.degrees["pp"] > 1 else 1
    p.recompute_layers = candidate.recompute_layers
    p.per_rank = rows
    p.model_flops = global_batch * summary.fwd_per_sample * (1 + summary.bwd_ratio)
    p.peak_flops = cluster.peak_flops or cluster.flops
    return p


_SESSION = weakref.WeakKeyDictionary()  # model -> {(seq_len, example_input, loss, roles): (signature, info, ms)}


def _signature(model):
    return tuple((n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()) + tuple(
        (n, type(m).__name__) for n, m in model.named_modules())


def _analyse(model, seq_len, example_input, loss, roles):
    """(ModelInfo, ModelSummary) of ``model`` at ``seq_len``: traced once per model and arguments (a session of
    ``plan`` / ``evaluate_plan`` calls reuses it while the model's parameters and modules are unchanged)."""
    key = (seq_len, id(example_input), id(loss), tuple(sorted((roles or {}).items())))
    sig = _signature(model)
    try:
        cache = _SESSION.setdefault(model, {})
    except TypeError:  # not weak-referenceable: no cache
        cache = {}
    hit = cache.get(key)
    if hit is not None and hit[0] == sig and hit[3] is example_input and hit[4] is loss:
        return hit[1], hit[2]
    trace = trace_model(model, seq_len, example_input=example_input, loss=loss)
    info = infer_roles(model, trace, roles)
    ms = _summary(info, trace, model)
    cache[key] = (sig, info, ms, example_input, loss)
    return info, ms


def _summary(info, trace, model):
    """The cost model's summary of the trace, with what selective AC saves per block (``selective_ac``)."""
    from hyper_parallel.auto.selective_ac import block_sac_bytes
    ms = summarize(info, trace, model)
    ms.blk_sac = block_sac_bytes(info, trace)
    return ms


def _check(degrees, info, cluster, global_batch, seq_len, allowed, n_layers, n_experts,
           searching: bool = True) -> Optional[str]:
    """Why layout ``degrees`` cannot run, or None. ``searching``: also prune what runs but never wins (tp across
    nodes); ``evaluate_plan`` evaluates such a layout when asked (its TP collectives at the inter-node rate)."""
    for k, flag in (("dp", "dp"), ("fsdp", "fsdp"), ("tp", "tp"), ("pp", "pp"), ("cp", "cp"), ("ep", "ep")):
        if degrees[k] > 1 and flag not in allowed:
            return f"{k}={degrees[k]} but {flag!r} is not in parallelisms"
    dp, fsdp, tp, pp, cp, ep = (degrees[k] for k in ("dp", "fsdp", "tp", "pp", "cp", "ep"))
    if global_batch % (dp * fsdp):
        return f"global_batch={global_batch} is not divisible by dp*fsdp={dp * fsdp}"
    if tp > 1:
        for what, n in (("n_heads", info.n_heads), ("n_kv_heads", info.n_kv_heads), ("the MLP hidden size", info.ffn_hidden),
                        ("the vocabulary", info.vocab)):
            if n % tp:
                return f"tp={tp} does not divide {what} ({n})"
        if searching and tp > cluster.devices_per_node:
            return f"tp={tp} > devices_per_node={cluster.devices_per_node} (tensor parallelism stays within a node)"
    if pp > n_layers:
        return f"pp={pp} > {n_layers} layers"
    if cp > 1 and seq_len % (2 * cp):
        return f"2*cp={2 * cp} does not divide seq_len={seq_len} (load-balanced head-tail shards of equal length)"
    if ep > 1:
        if n_experts % ep:
            return f"ep={ep} does not divide the {n_experts} experts"
        if dp > 1:
            return "ep with dp (HSDP) replicas is not supported (ep borrows ranks from fsdp)"
        if cp > 1:
            return "ep with cp is not supported"
        if pp > 1 and tp > 1:
            return "ep with both pp and tp is not supported"
    if cp > 1 and dp > 1 and fsdp > 1:
        return "cp with HSDP (dp > 1 and fsdp > 1) is not supported"
    return None


def _make_plan(candidate, mem, step_time, lps, cluster, global_batch, seq_len, param_dtype, reduce_dtype, info):
    d = dict(candidate.degrees)
    if d["pp"] > 1:
        names, shape = ["pp"], [d["pp"]]
    else:
        names, shape = [], []
    for k in ("dp", "fsdp", "cp", "tp"):
        if d[k] > 1:
            if k == "fsdp" and d["ep"] > 1:
                names += ["efsdp", "ep"]
                shape += [d["fsdp"] // d["ep"], d["ep"]]
            else:
                names.append(k)
                shape.append(d[k])
    if not names:
        names, shape = ["dp"], [1]
    return Plan(degrees=d, sequence_parallel=bool(candidate.sp), activation_checkpointing=candidate.ac,
                pp_schedule=candidate.schedule, microbatches=candidate.microbatches, layers_per_stage=lps,
                cp_method=candidate.cp_method, memory=mem, step_time=step_time, mesh_shape=tuple(shape),
                mesh_dim_names=tuple(names), world_size=cluster.world_size, global_batch=global_batch, seq_len=seq_len,
                param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                device_memory=cluster.device_memory, fits=mem.total <= cluster.device_memory, _model_info=info)
