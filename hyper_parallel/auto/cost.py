"""Cost model: per-rank memory and step time of one candidate layout (equations: docs/auto_parallel.md).

Everything here is arithmetic on a :class:`ModelSummary` (built once per ``plan()`` call from the meta
trace), so one candidate costs microseconds and thousands are scored in well under a second.

On a calibrated CPU world (``Cluster.measure()`` found host costs) the step also pays the library's host
work, counted from the trace (:class:`HostCounts`): aten ops, ops dispatched on DTensors, AdamW's
per-parameter steps, ``fully_shard`` units, and each collective's measured per-call time at its group size.
"""
# Names: a parameter holding one parallel dimension's degree (ranks in one group of it) is ``<dim>_size``
# (``tp_size``, ``pp_size``, ...; torch's ``mesh["tp"].size()``, torchtitan's ``parallel_dims.tp``); the whole
# layout is ``degrees`` ({dim: size}); ``summary`` is the ModelSummary, ``candidate`` the Candidate. Inside
# ``evaluate`` the locals keep the equations' short names (``tp``, ``pp``, ``m`` microbatches, ``v`` stages per
# rank; docs/auto_parallel.md "Cost model").
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Dict, List

import torch

from hyper_parallel.auto.memory import OPT_STATES, ParamGroups, group_params, shard_degrees
from hyper_parallel.auto.model_stats import Trace
from hyper_parallel.auto.plan import Memory, StepTime
from hyper_parallel.auto.roles import ModelInfo

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
GATHERED = {"attention_q", "attention_k", "attention_v", "mlp_gate", "mlp_up", "router", "experts",
            "attention_qkv", "attention_kv", "attention_q_a", "attention_kv_a", "mlp_gate_up"}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2}


@dataclasses.dataclass
class ModelSummary:
    info: ModelInfo
    groups: ParamGroups
    seq_len: int
    act_item: int                     # bytes per activation element in the trace
    blk_fwd: List[float]              # forward FLOPs per block, per sample
    blk_expert_fwd: List[float]       # of which grouped-expert FLOPs (not divided by tp)
    blk_attn_fwd: List[float]         # of which sdpa FLOPs
    head_fwd: float                   # forward FLOPs outside the blocks, per sample
    bwd_ratio: float                  # backward / forward FLOPs
    blk_inner: List[float]            # saved bytes per sample inside attention / MLP / MoE (sharded by tp)
    blk_outer: List[float]            # saved bytes per sample elsewhere in the block (sharded by tp with SP)
    first_saved: float
    last_saved: float
    model_buffers: int                # bytes of the model's own buffers
    blk_gathered: List[float] = None  # saved bytes per sample that stay whole under tp (colwise inputs, experts)
    blk_ops: List[int] = None         # aten ops per block forward (any batch)
    head_ops: int = 0
    bwd_op_ratio: float = 2.0
    host: "HostCounts" = None         # what the library dispatches per block under TP / FSDP (host costs)
    blk_ew_inner: List[float] = None  # bytes written per sample by memory-bound ops inside attention / MLP
    blk_ew_outer: List[float] = None  # ... elsewhere in the block (norms, residual adds)
    top_ew: float = 0.0               # ... outside the blocks (embedding, final norm, head, loss)
    weights: tuple = None             # (block weights, first, last) of the stage split (pipelining.weights_of)

    @property
    def n_layers(self):
        return len(self.blk_fwd)

    @property
    def fwd_per_sample(self) -> float:
        """The model's forward FLOPs per sample (causal attention counted as the kernel runs it)."""
        return sum(self.blk_fwd) + self.head_fwd


TP_ROLES = {"attention_q", "attention_k", "attention_v", "attention_o", "mlp_gate", "mlp_up", "mlp_down",
            "embedding", "output", "attention_qkv", "attention_kv", "mlp_gate_up"}


@dataclasses.dataclass
class HostCounts:
    """Per block (and outside the blocks: ``top_*``), what costs host time on a CPU world.

    ``dt_tp``: torch-function calls in the modules TP shards (each one op dispatched on DTensors per forward);
    ``dt_norm``: the same in the norms (DTensors only with sequence parallelism);
    ``p_tp`` / ``p_norm`` / ``p_all``: parameter tensors (AdamW steps them one by one: on DTensors when sharded);
    ``sites``: attention + dense MLP modules (one TP gather/reduce pair per direction each).
    """

    dt_tp: List[int]
    dt_norm: List[int]
    p_tp: List[int]
    p_norm: List[int]
    p_all: List[int]
    sites: List[int]
    top_dt_tp: int
    top_dt_norm: int
    top_p_tp: int
    top_p_norm: int
    top_p_all: int


def host_counts(info: ModelInfo, trace: Trace) -> HostCounts:
    mods, roles = trace.modules, info.module_roles
    nb = len(info.block_names)
    inside = lambda module, block: module == block or module.startswith(block + ".")
    block_of = lambda module: next((i for i, b in enumerate(info.block_names) if inside(module, b)), None)
    dt_tp, dt_norm = [0] * nb, [0] * nb
    top = dict(dt_tp=0, dt_norm=0, p_tp=0, p_norm=0, p_all=0)
    for f, t in mods.items():
        r = roles.get(f)
        key = "dt_tp" if r in TP_ROLES else "dt_norm" if r == "norm" else None
        if key is None:
            continue
        i = block_of(f)
        if i is None:
            top[key] += t.tf_ops
        else:
            (dt_tp if key == "dt_tp" else dt_norm)[i] += t.tf_ops
    p_tp, p_norm, p_all = [0] * nb, [0] * nb, [0] * nb
    for p in info.params:
        kind = "p_tp" if p.role in TP_ROLES else "p_norm" if p.role == "norm" else None
        if p.block is None:
            top["p_all"] += 1
            if kind:
                top[kind] += 1
        else:
            p_all[p.block] += 1
            if kind:
                (p_tp if kind == "p_tp" else p_norm)[p.block] += 1
    moe = lambda module: any(inside(module, k) for k in info.moe_modules)
    sites = [sum(1 for m in info.attention_modules + [x for x in info.mlp_modules if not moe(x)] if inside(m, b))
             for b in info.block_names]
    return HostCounts(dt_tp, dt_norm, p_tp, p_norm, p_all, sites, top["dt_tp"], top["dt_norm"], top["p_tp"],
                      top["p_norm"], top["p_all"])


def summarize(info: ModelInfo, trace: Trace, model) -> ModelSummary:
    mods = trace.modules
    nb = len(info.block_names)
    b = trace.batch
    inner_kinds = set(info.attention_modules) | set(info.mlp_modules) | set(info.moe_modules)
    blk_fwd, blk_exp, blk_attn, blk_in, blk_out, blk_gat, blk_ops = [], [], [], [], [], [], []
    ew_in, ew_out = [], []
    for name in info.block_names:
        blk_fwd.append(mods[name].fwd_flops / b if name in mods else 0.0)
        exp = sum(t.fwd_flops for f, t in mods.items() if f.startswith(name + ".")
                  and info.module_roles.get(f) == "experts")
        blk_exp.append(exp / b)
        blk_attn.append(sum(mods[a].sdpa_flops for a in info.attention_modules if a.startswith(name + ".")) / b)
        inner = outer = gathered = e_in = e_out = 0
        for f, t in mods.items():
            if f == name or f.startswith(name + "."):
                if any(f == k or f.startswith(k + ".") for k in inner_kinds):
                    e_in += t.ew_bytes
                else:
                    e_out += t.ew_bytes
                role = info.module_roles.get(f)
                in_moe = any(f == k or f.startswith(k + ".") for k in info.moe_modules)
                if role in GATHERED or (in_moe and role not in ("attention_o", "mlp_down")):
                    gathered += t.saved_bytes  # full-size inputs of colwise projections; experts replicated over tp
                elif any(f == k or f.startswith(k + ".") for k in inner_kinds):
                    inner += t.saved_bytes
                else:
                    outer += t.saved_bytes
        blk_in.append(inner / b)
        blk_out.append(outer / b)
        blk_gat.append(gathered / b)
        ew_in.append(e_in / b)
        ew_out.append(e_out / b)
        blk_ops.append(sum(t.ops for f, t in mods.items() if f == name or f.startswith(name + ".")))
    in_blocks = lambda module: any(module == n or module.startswith(n + ".") for n in info.block_names)
    emb = {k for k, v in info.module_roles.items() if v == "embedding"}
    first = sum(t.saved_bytes for f, t in mods.items() if f in emb) / b
    last = sum(t.saved_bytes for f, t in mods.items() if not in_blocks(f) and f not in emb) / b
    head = max(trace.fwd_flops / b - sum(blk_fwd), 0.0)
    item = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    bufs = sum(x.numel() * x.element_size() for x in model.buffers())
    top_ew = sum(t.ew_bytes for f, t in mods.items() if not in_blocks(f)) / b
    return ModelSummary(info, group_params(info), trace.seq_len, item, blk_fwd, blk_exp, blk_attn, head,
                        trace.bwd_flops / max(trace.fwd_flops, 1), blk_in, blk_out, first, last, bufs, blk_gat,
                        blk_ops, max(trace.fwd_ops - sum(blk_ops), 0), trace.bwd_ops / max(trace.fwd_ops, 1),
                        host_counts(info, trace), ew_in, ew_out, top_ew, split_weights(info))


def split_weights(info: ModelInfo):
    """The stage split's weights (``hyper_parallel.pipelining.weights_of``): matmul FLOPs per token (2 x the
    parameters, an embedding 0) and parameter bytes of each block, of the embedding and of the rest outside
    the blocks, as ``pipelining.stage_weights`` reads them from a model (so ``Plan.apply`` and
    ``split_into_stages`` agree)."""
    from hyper_parallel.pipelining.split import weights_of
    nb = len(info.block_names)
    blocks = [[0.0, 0.0] for _ in range(nb)]
    first, last = [0.0, 0.0], [0.0, 0.0]
    for p in info.params:
        n = 1
        for v in p.shape:
            n *= v
        item = torch.empty((), dtype=p.dtype).element_size()
        dst = blocks[p.block] if p.block is not None else first if p.role == "embedding" else last
        dst[0] += 0.0 if p.role == "embedding" else 2.0 * n
        dst[1] += n * item
    return weights_of([tuple(x) for x in blocks], tuple(first), tuple(last))


@dataclasses.dataclass
class Candidate:
    degrees: Dict[str, int]
    sp: bool
    ac: str
    schedule: str = None
    microbatches: int = 1
    cp_method: str = None
    stages_per_rank: int = 1          # virtual stages per pipeline rank (interleaved schedules)
    stage_layers: tuple = None        # blocks per stage module (None: the balanced split)
    recompute_layers: int = None      # AC "full" on the first k blocks of every stage only (None: all)


@functools.lru_cache(maxsize=4096)
def _spans(pp_size, dp_size, fsdp_size, cp_size, tp_size):
    """{dim: contiguous ranks one group of dim spans} for the mesh order (pp, dp, fsdp, cp, tp)."""
    order, sizes = (["pp", "dp", "fsdp", "cp", "tp"],
                    {"pp": pp_size, "dp": dp_size, "fsdp": fsdp_size, "cp": cp_size, "tp": tp_size})
    return {k: _span(order, sizes, k) for k in order}


def _span(order, sizes, dim):
    """Contiguous ranks one group of ``dim`` spans (mesh order row-major): its size x the inner dims' sizes."""
    i = order.index(dim)
    span = 1
    for d in order[i:]:
        span *= sizes[d]
    return span


def stage_layers(summary: ModelSummary, n_stage_modules: int) -> List[int]:
    """Blocks per stage module: the split that balances FLOPs and bytes (``pipelining.balanced_stage_layers``)."""
    from hyper_parallel.pipelining.split import balanced_stage_layers
    w, first, last = summary.weights
    return balanced_stage_layers(w, n_stage_modules, first_weight=first, last_weight=last,
                                 allow_empty=summary.n_layers < n_stage_modules)


def _stages(summary: ModelSummary, n_stage_modules: int, counts=None):
    """Per stage module: aggregates of its blocks (cached per split)."""
    cache = summary.__dict__.setdefault("_stage_cache", {})
    key = (n_stage_modules, tuple(counts) if counts else None)
    if key in cache:
        return cache[key]
    g = summary.groups
    counts = list(counts) if counts else stage_layers(summary, n_stage_modules)
    if len(counts) != n_stage_modules or sum(counts) != summary.n_layers:
        raise ValueError(f"stage_layers={counts} must give {n_stage_modules} stages {summary.n_layers} blocks in all")
    split, pos = [], 0
    for k in counts:
        split.append(list(range(pos, pos + k)))
        pos += k
    out = []
    for idx in split:
        kinds = sorted({g.block_kind[i] for i in idx})
        rep = {k: next(i for i in idx if g.block_kind[i] == k) for k in kinds}
        out.append(dict(
            blocks=idx, n=len(idx),
            fwd=sum(summary.blk_fwd[i] for i in idx), exp=sum(summary.blk_expert_fwd[i] for i in idx),
            attn=sum(summary.blk_attn_fwd[i] for i in idx), inner=sum(summary.blk_inner[i] for i in idx),
            outer=sum(summary.blk_outer[i] for i in idx), gathered=sum(summary.blk_gathered[i] for i in idx),
            ew_in=sum(summary.blk_ew_inner[i] for i in idx), ew_out=sum(summary.blk_ew_outer[i] for i in idx),
            reps=[(summary.blk_inner[rep[k]], summary.blk_outer[rep[k]], summary.blk_gathered[rep[k]]) for k in kinds],
            kind_counts={k: sum(1 for i in idx if g.block_kind[i] == k) for k in kinds},
            n_moe=sum(1 for i in idx if summary.info.block_is_moe[i]), ops=sum(summary.blk_ops[i] for i in idx),
            sites=sum(summary.host.sites[i] for i in idx), re_sites=sum(max(summary.host.sites[i] - 1, 0) for i in idx),
            p_norm=sum(summary.host.p_norm[i] for i in idx),
        ))
    cache[key] = out
    return out


def _rank_groups(stages, pp_size: int, stages_per_rank: int):
    """[(first rank, [ranks])]: pipeline ranks whose stages hold the same kinds of blocks and the same ends
    (embedding, head) cost the same time; the first of them holds the most microbatches (memory)."""
    nsm = pp_size * stages_per_rank
    key = lambda stage: (tuple(sorted(stages[stage]["kind_counts"].items())), stage == 0, stage == nsm - 1)
    groups = {}
    for r in range(pp_size):
        groups.setdefault(tuple(key(r + k * pp_size) for k in range(stages_per_rank)), []).append(r)
    return sorted((rs[0], rs) for rs in groups.values())


def _rank_state(groups, degrees, mine, first: bool, last: bool, optimizer: str):
    """(params, grads, optimizer bytes, parameter tensors) of rank 0 of a pipeline rank holding ``mine``."""
    tp, ep = degrees["tp"], degrees["ep"]
    shard, expert_shard = shard_degrees(degrees)
    b = n = 0
    for x in mine:
        for k, cnt in x["kind_counts"].items():
            b += cnt * groups.bytes_of(k, tp, shard, ep, expert_shard)
            n += cnt * groups.n_tensors_kind[k]
    if first:
        b += groups.bytes_of("first", tp, shard, ep, expert_shard)
        n += groups.n_tensors_first
    if last:
        b += groups.bytes_of("last", tp, shard, ep, expert_shard)
        n += groups.n_tensors_last
    return b, b, OPT_STATES[optimizer] * b, n


def state_floor(summary: ModelSummary, degrees, optimizer: str) -> float:
    """A lower bound of any pipeline rank's parameter + gradient + optimizer bytes under ``degrees``, whatever the
    schedule and split: the whole model's sharded state over ``pp`` ranks (the fullest rank holds at least the
    mean)."""
    g = summary.groups
    whole = [dict(kind_counts=dict(collections.Counter(g.block_kind)))]
    params, grads, opt, _ = _rank_state(g, degrees, whole, True, True, optimizer)
    return (params + grads + opt) / degrees["pp"]


def in_flight(schedule: str, microbatches: int, pp_size: int, stages_per_rank: int, rank: int) -> float:
    """Microbatches whose activations pipeline rank ``rank`` holds at its peak, in units of all its stages'
    activations of one microbatch: GPipe all ``microbatches``; 1F1B ``pp_size - rank`` (the last rank 1);
    interleaved with ``stages_per_rank`` (v) stages per rank the warm-up of torch's / Megatron's schedule,
    ``2 (pp_size - 1 - rank) + (v - 1) pp_size + 1`` stage-microbatches, over ``v``."""
    if pp_size <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "1f1b":
        return float(min(microbatches, pp_size - rank))
    return min(microbatches * stages_per_rank,
               2 * (pp_size - 1 - rank) + (stages_per_rank - 1) * pp_size + 1) / stages_per_rank


def tp_collectives(host: HostCounts, blocks, sequence_parallel: bool, full_ac: bool, first: bool,
                   last: bool) -> Dict[tuple, int]:
    """TP collectives of one microbatch's forward + backward: ``{(kind, "act" | "logits"): count}``.

    Per site (attention, MLP), with SP: all_gather in, reduce_scatter out, the reverse in backward; without:
    all_reduce out, all_reduce of the input gradient. Activation checkpointing recomputes a block's forward
    but stops after its last saved tensor (the last site's output collective is not redone). The embedding
    (RowwiseParallel) reduces its output (SP: reduce_scatter, gradient all_gather); the head
    (ColwiseParallel, replicated logits) all_gathers the logits and reduces its input gradient (SP: it also
    gathers its sequence-sharded input)."""
    return _tp_counts(sum(host.sites[i] for i in blocks), sum(max(host.sites[i] - 1, 0) for i in blocks),
                      sequence_parallel, full_ac, first, last)


def _tp_counts(sites: int, re_sites: int, sequence_parallel: bool, full_ac: bool, first: bool,
               last: bool) -> Dict[tuple, int]:
    """:func:`tp_collectives` from the stage's site counts (``re_sites``: sum of ``sites_block - 1``)."""
    re_sites = re_sites if full_ac else 0
    out = {}
    if sequence_parallel:
        out[("all_gather", "act")] = 2 * sites + (sites if full_ac else 0) + int(first) + int(last)
        out[("reduce_scatter", "act")] = 2 * sites + re_sites + int(first) + int(last)
    else:
        out[("all_reduce", "act")] = 2 * sites + re_sites + int(first) + int(last)
    if last:
        out[("all_gather", "logits")] = 1
    return out


def blocks_of(stages):
    return [i for x in stages for i in x["blocks"]]


def _host_time(summary, cluster, candidate, st_ids, blocks, nsm, microbatches, tp_size, shard):
    """Seconds of host work beyond the aten ops: ops dispatched on DTensors (TP, SP norms; again when
    activation checkpointing recomputes them) and AdamW's per-parameter steps (on DTensors when sharded)."""
    hc = summary.host
    top = 0 in st_ids or (nsm - 1) in st_ids
    sp = candidate.sp and tp_size > 1
    n_all = sum(hc.p_all[i] for i in blocks) + (hc.top_p_all if top else 0)
    t = 0.0
    if tp_size > 1:
        dt = sum(hc.dt_tp[i] + (hc.dt_norm[i] if sp else 0) for i in blocks)
        dt_top = hc.top_dt_tp + (hc.top_dt_norm if sp else 0) if top else 0
        t += microbatches * ((2 if candidate.ac in ("full", "selective") else 1) * dt + dt_top) * cluster.dtensor_op
    if shard > 1:  # fully_shard: every parameter is a DTensor
        n_dt = n_all
    elif tp_size > 1:
        n_dt = sum(hc.p_tp[i] + (hc.p_norm[i] if sp else 0) for i in blocks)
        n_dt += (hc.top_p_tp + (hc.top_p_norm if sp else 0)) if top else 0
    else:
        n_dt = 0
    plain, dtensor = cluster.optim
    return t + n_dt * dtensor + (n_all - n_dt) * plain


def _rank_agg(summary: ModelSummary, stages, pp_size: int, stages_per_rank: int, rank: int, group):
    """What evaluate reads of pipeline rank ``rank``'s stages that no candidate choice changes (cached per split):
    the candidate loop then does arithmetic only, in the same order as on the stage dicts (identical floats)."""
    cache = summary.__dict__.setdefault("_rank_cache", {})
    key = (id(stages), pp_size, stages_per_rank, rank)
    agg = cache.get(key)
    if agg is not None:
        return key, agg
    nsm = pp_size * stages_per_rank
    st_ids = [rank + k * pp_size for k in range(stages_per_rank)]
    mine = [stages[s] for s in st_ids]
    agg = dict(
        key=key, rank=rank, group=group, st_ids=st_ids, mine=mine, first=0 in st_ids, last=(nsm - 1) in st_ids,
        nblk=sum(x["n"] for x in mine), blocks=[x["n"] for x in mine],
        iog=[(x["inner"], x["outer"], x["gathered"]) for x in mine],
        reps=[rep for x in mine for rep in x["reps"]],
        kinds=tuple({k for x in mine for k in x["kind_counts"]}),
        mm_fe=sum(x["fwd"] - x["exp"] - x["attn"] for x in mine), exp=sum(x["exp"] for x in mine),
        attn=sum(x["attn"] for x in mine), ops=sum(x["ops"] for x in mine),
        ew=[(x["ew_in"], x["ew_out"]) for x in mine],
        sites=sum(x["sites"] for x in mine), re_sites=sum(x["re_sites"] for x in mine),
        p_norm=sum(x["p_norm"] for x in mine), n_moe=sum(x["n_moe"] for x in mine),
        state={}, blk={},
    )
    cache[key] = agg
    return key, agg


def _agg_state(summary: ModelSummary, agg, degrees, optimizer: str, key: tuple):
    """:func:`_rank_state` of a rank's aggregates, cached per ``key``: (tp, ep, shard, expert shard, optimizer)
    of ``degrees``."""
    out = agg["state"].get(key)
    if out is None:
        out = agg["state"][key] = _rank_state(summary.groups, degrees, agg["mine"], agg["first"], agg["last"],
                                              optimizer)
    return out


def evaluate(summary: ModelSummary, cluster, candidate: Candidate, *, global_batch: int, optimizer: str,
             param_item: int, reduce_item: int, memory_limit: float = None):
    """-> (Memory, StepTime, layers per stage module, per-rank rows) of ``candidate``: every pipeline rank is
    modelled (its blocks, in-flight activations, collectives); the memory is the largest rank's, the step the
    slowest rank's plus the bubble (docs/auto_parallel.md "Cost model"). A candidate whose memory exceeds
    ``memory_limit`` (bytes; ``plan()``'s device memory) gets no step time (``None``) and rows with memory only."""
    d = candidate.degrees
    dp, fsdp, tp, pp, cp, ep = (d[k] for k in ("dp", "fsdp", "tp", "pp", "cp", "ep"))
    info, g = summary.info, summary.groups
    v = (candidate.stages_per_rank or STAGES_PER_RANK.get(candidate.schedule, 1)) if pp > 1 else 1
    nsm = pp * v
    stages = _stages(summary, nsm, candidate.stage_layers)
    shard, expert_shard = shard_degrees(d)
    d1 = dict(d, fsdp=1, cp=1, pp=1)
    b_local = global_batch // (dp * fsdp)
    m = candidate.microbatches if pp > 1 else 1
    b_mb = b_local / m
    sp_div = tp if candidate.sp else 1
    act_scale = param_item / summary.act_item  # activations in the compute dtype
    S = summary.seq_len
    hidden_bytes = S / cp * info.dim * param_item  # one sample's hidden state [S/cp, dim]
    dpn = cluster.devices_per_node
    intra = lambda span: span <= dpn
    ct = cluster.collective_time
    calibrated_host = bool(cluster.op_overhead)  # a CPU world measured by Cluster.measure()
    memo = cluster.__dict__.get("_cost_memo")  # a plan() search shares sub-results between its candidates
    if memo is None:
        memo = {}
    full_ac = candidate.ac in ("full", "selective")  # both rerun the forward's TP collectives in backward
    rows = []
    groups_cache = summary.__dict__.setdefault("_group_cache", {})
    gkey = (id(stages), pp, v)
    aggs = groups_cache.get(gkey)
    if aggs is None:
        aggs = groups_cache[gkey] = [_rank_agg(summary, stages, pp, v, r, group)
                                     for r, group in _rank_groups(stages, pp, v)]
    spans = _spans(pp, dp, fsdp, cp, tp)
    state_key = (tp, ep, shard, expert_shard, optimizer)
    if shard > 1 and pp > 1:
        whole_key = (tp, ep) + shard_degrees(d1) + (optimizer,)
    pre = []  # per rank: its memory first (a candidate over ``memory_limit`` stops there), then its time
    for akey, agg in aggs:  # ranks alike but for their in-flight count: the first holds most
        r, group = agg["rank"], agg["group"]
        st_ids, mine, first, last = agg["st_ids"], agg["mine"], agg["first"], agg["last"]
        # ------------------------------------------------------------ memory of this rank
        params, _, opt, ntens = _agg_state(summary, agg, d, optimizer, state_key)
        if shard > 1 and pp > 1:  # no reshard after forward: the stage's whole parameters and gradients, once
            unsharded = _agg_state(summary, agg, d1, optimizer, whole_key)[0]
        nblk = agg["nblk"]
        acts_key = ("acts", akey, tp, cp, candidate.sp, candidate.ac, candidate.recompute_layers, param_item)
        parts = memo.get(acts_key)
        if parts is None:  # the same for every dp / fsdp / ep split, microbatch count and schedule of this rank
            # Megatron's "block" recompute: the first k blocks
            if candidate.ac == "full" and candidate.recompute_layers is not None:
                ck = [i for x in mine for i in x["blocks"][:candidate.recompute_layers]]
                rest = [i for x in mine for i in x["blocks"][candidate.recompute_layers:]]
                full_acts = lambda block: (summary.blk_inner[block] / tp + summary.blk_outer[block] / sp_div
                                           + summary.blk_gathered[block]) / cp
                kept = len(ck) * hidden_bytes / sp_div / act_scale + sum(full_acts(i) for i in rest)
                working = max((full_acts(i) for i in ck), default=0.0)
            elif candidate.ac == "full":
                kept = nblk * hidden_bytes / sp_div / act_scale
                working = max(((i / tp + o / sp_div + gg) for i, o, gg in agg["reps"]), default=0) / cp
            elif candidate.ac == "selective":  # auto.selective_ac: inputs + matmul/attention outputs per block
                from hyper_parallel.auto.selective_ac import selective_parts
                kept, working = selective_parts(summary, mine, tp, sp_div, cp, hidden_bytes / act_scale)
            else:
                kept = sum(i / tp + o / sp_div + gg for i, o, gg in agg["iog"]) / cp
                working = 0.0
            if first:
                kept += summary.first_saved / sp_div / cp
            parts = memo[acts_key] = (kept, working)
        kept, working = parts
        held = in_flight(candidate.schedule, m, pp, v, r)
        if last or pp == 1:  # the head's activations (logits): the last stage runs each microbatch's backward
            # right after its forward (1F1B, interleaved), GPipe keeps all m
            working += summary.last_saved / cp * (m if candidate.schedule == "gpipe" else 1)
        acts = act_scale * b_mb * (held * kept + working)  # the recompute working set lives once
        blk = agg["blk"].get((tp, ep))
        if blk is None:
            blk = agg["blk"][(tp, ep)] = max((g.kind_dense_bytes[k] / tp + g.kind_expert_bytes[k] / (ep if ep > 1 else 1)
                                              for k in agg["kinds"]), default=0) / summary.act_item
        if shard > 1 and pp > 1:  # gathered once per step, kept to the last backward; unsharded gradients
            whole = unsharded / summary.act_item
            bufs = whole * (param_item + reduce_item)
        elif shard > 1:  # the all-gathered block, the prefetched next one, the reduce-scatter input
            bufs = blk * (2 * param_item + reduce_item)
        elif dp * cp > 1:  # the flat gradient all_reduce runs after backward, when the activations are gone
            bufs = max(0.0, params * reduce_item / summary.act_item - acts)
        else:
            bufs = 0
        bufs += 4 * ntens + summary.model_buffers
        mem = Memory(int(params), int(params), int(opt), int(acts), int(bufs))
        pre.append((akey, agg, r, group, st_ids, mine, first, last, params, nblk, held, mem))
    worst_mem = max(pre, key=lambda row: row[-1].total)[-1]
    if memory_limit is not None and worst_mem.total > memory_limit:  # does not fit: its step time is not needed
        return worst_mem, None, [x["n"] for x in stages], [dict(rank=x[2], ranks=x[3], stages=x[4], memory=x[-1])
                                                           for x in pre]
    for akey, agg, r, group, st_ids, mine, first, last, params, nblk, held, mem in pre:
        # ------------------------------------------------------------ compute of this rank
        compute_key = ("compute", akey, tp, cp, b_local, candidate.ac, candidate.recompute_layers, candidate.sp, m,
                       param_item, shard if calibrated_host else None)
        parts = memo.get(compute_key)
        if parts is None:  # the same for every dp / fsdp / ep split of this local batch and the cp method
            re_mm = mm = agg["mm_fe"] / (tp * cp) + agg["exp"] / cp
            attn = agg["attn"] / (tp * cp)
            if last or pp == 1:
                mm += summary.head_fwd / (tp * cp)
            re_attn = attn
            if candidate.ac != "full":  # selective AC recomputes no matmul and no attention
                re_mm = re_attn = 0.0
            elif candidate.recompute_layers is not None:  # only the checkpointed blocks run their forward again
                ck = [i for x in mine for i in x["blocks"][:candidate.recompute_layers]]
                re_attn = sum(summary.blk_attn_fwd[i] for i in ck) / (tp * cp)
                re_mm = (sum(summary.blk_fwd[i] - summary.blk_expert_fwd[i] - summary.blk_attn_fwd[i] for i in ck)
                         / (tp * cp)
                         + sum(summary.blk_expert_fwd[i] for i in ck) / cp)
            flops = b_local * (mm * (1 + summary.bwd_ratio) + re_mm + attn * (1 + summary.bwd_ratio) + re_attn)
            ops = agg["ops"] + (summary.head_ops if last or pp == 1 else 0)
            re_ops = agg["ops"] if full_ac else 0
            if candidate.ac == "full" and candidate.recompute_layers is not None:
                re_ops = sum(summary.blk_ops[i] for x in mine for i in x["blocks"][:candidate.recompute_layers])
            if calibrated_host:  # eager CPU: matmuls at the measured rate, then the host's work per operator
                compute = flops / cluster.flops
                compute += m * (ops * (1 + summary.bwd_op_ratio) * cluster.op_overhead
                                + re_ops * (cluster.ac_op or cluster.op_overhead))
                compute += _host_time(summary, cluster, candidate, st_ids, blocks_of(mine), nsm, m, tp, shard)
            else:  # a device: kernels (matmul, attention, memory-bound ops); the host launches ahead of them
                kernel = b_local * ((mm * (1 + summary.bwd_ratio) + re_mm) / cluster.flops
                                    + (attn * (1 + summary.bwd_ratio) + re_attn) / cluster.attention_flops)
                hbm = 0.0
                if cluster.hbm_bw:  # memory-bound ops: each writes its output and reads about as much; backward 2x
                    ew = sum(e_in / tp + e_out / sp_div for e_in, e_out in agg["ew"]) / cp
                    ew_top = summary.top_ew / cp if (first or last or pp == 1) else 0.0
                    ew_re = ew if full_ac else 0.0
                    hbm = b_local * act_scale * 2 * ((ew + ew_top) * (1 + summary.bwd_ratio) + ew_re) / cluster.hbm_bw
                host = m * (ops * (1 + summary.bwd_op_ratio) + re_ops) * cluster.launch
                compute = max(kernel + hbm, host)
            parts = memo[compute_key] = (flops, compute, attn)
        flops, compute, attn = parts
        # ------------------------------------------------------------ communication of this rank
        comm: Dict[str, float] = {}
        hc = summary.host
        if tp > 1:  # TP / SP per microbatch: the collectives the library's styles issue, on the compute stream
            tp_key = ("tp", akey, tp, cp, candidate.sp, full_ac, m, b_local, param_item)
            if tp_key in memo:
                comm["tp"] = memo[tp_key]
            else:
                a = b_mb * hidden_bytes
                span = spans["tp"]
                logits = b_mb * S / cp * info.vocab * param_item
                size = {"act": a, "logits": logits}
                counts = _tp_counts(agg["sites"], agg["re_sites"], candidate.sp, full_ac,
                                    first or pp == 1, last or pp == 1)
                t = sum(cnt * ct(kind, size[what], tp, intra(span)) for (kind, what), cnt in counts.items())
                comm["tp"] = t * m
                if candidate.sp:  # the SP norms' replicated weights: one all_reduce of their gradients per step
                    comm["tp"] += ct("all_reduce", 4 * info.dim * (agg["p_norm"] + hc.top_p_norm),
                                     tp, intra(span))
                memo[tp_key] = comm["tp"]
        if cp > 1:  # CP: ring K/V p2p overlapped with attention compute, or Ulysses all_to_all (q, k, v, out)
            span = spans["cp"]
            if candidate.cp_method == "ring":
                kv = 2 * b_mb * S / cp * info.n_kv_heads / tp * info.head_dim * param_item
                ring = 3 * (cp - 1) * ct("p2p", kv, 2, intra(span)) * nblk * m
                attn_t = b_local * attn * (1 + summary.bwd_ratio) / (cluster.flops if calibrated_host
                                                                  else cluster.attention_flops)
                comm["cp"] = max(0.0, ring - attn_t)
            else:
                a = b_mb * S / cp * info.dim / tp * param_item
                comm["cp"] = 8 * ct("all_to_all", a, cp, intra(span)) * nblk * m
        n_moe = agg["n_moe"]
        if ep > 1 and n_moe:  # EP: dispatch + combine all_to_all, forward and backward
            rows_b = b_mb * S / cp * info.top_k * info.dim * param_item
            comm["ep"] = 4 * ct("all_to_all", rows_b, ep, intra(ep * cp * tp)) * n_moe * m
        calls = {}
        if shard > 1:  # FSDP units: a block each, and the stage's root when it holds parameters (embedding, head)
            units = nblk + sum(1 for s in st_ids if s == 0 or s == nsm - 1 or pp == 1)
            calls = {"all_gather": units if pp > 1 else 2 * nblk + 1, "reduce_scatter": units}
            comm["fsdp"] = _fsdp_time(summary, cluster, mine, d, tp, ep, shard, expert_shard, param_item, reduce_item,
                                      compute, m, v, spans, intra,
                                      memo_key=(akey, dp, fsdp, tp, pp, cp, ep, v, param_item, reduce_item))
        elif dp * cp > 1:  # replicated: one flat gradient all_reduce after backward
            span = spans["dp"] if dp > 1 else spans["cp"]
            comm["dp"] = ct("all_reduce", params * reduce_item / summary.act_item, dp * cp, intra(span))
        if pp > 1:  # each microbatch's boundary activation in, its gradient out (torch waits on the receive)
            span = spans["pp"]
            comm["pp"] = 2 * m * v * ct("p2p", b_mb * hidden_bytes / sp_div, 2, intra(span))
        rows.append(dict(rank=r, ranks=group, stages=st_ids, blocks=list(agg["blocks"]), in_flight=held, memory=mem,
                         fsdp_calls=calls,
                         flops=flops, compute=compute, comm=comm, busy=compute + sum(comm.values())))
    slow = max(rows, key=lambda row: row["busy"])
    bubble = slow["busy"] * (pp - 1) / (m * v) if pp > 1 else 0.0
    st = StepTime(slow["compute"], sum(slow["comm"].values()), bubble, dict(slow["comm"]))
    peak = cluster.peak_flops or cluster.flops
    busiest = max(x["flops"] for x in rows)
    if st.total < busiest / peak * (1 - 1e-9):  # never a prediction below physics
        raise RuntimeError(f"cost model: predicted step {st.total:.6g} s is shorter than the busiest rank's "
                           f"{busiest:.4g} FLOPs at the peak {peak:.4g} FLOP/s ({busiest / peak:.6g} s); "
                           "this is a bug in hyper_parallel.auto.cost, please report it with the plan")
    return worst_mem, st, [x["n"] for x in stages], rows


def _fsdp_time(summary, cluster, mine, degrees, tp_size, ep_size, shard, expert_shard, param_item, reduce_item,
               compute, microbatches, stages_per_rank, spans, intra, memo_key=None):
    """Exposed seconds of FSDP's collectives on one rank. Without pp: all_gather (forward and again in
    backward) and reduce_scatter per block, prefetch hiding all but the first behind compute. With pp: the
    stage is gathered once per step and its gradients reduce-scattered once (no reshard after forward, as
    torchtitan): the gathers beyond the first hide behind the first microbatch's forward, the reduce-scatters
    behind the last one's backward. A calibrated CPU world (gloo on the cores that compute) overlaps nothing
    and pays the measured per-unit host cost.

    ``memo_key``: the rank and layout, to reuse the collectives' sums (they do not depend on ``compute`` or
    ``microbatches``) within one ``plan()`` search (the cluster's ``_cost_memo``, which ``plan`` sets on its
    private copy)."""
    memo = cluster.__dict__.get("_cost_memo") if memo_key is not None else None
    parts = memo.get(memo_key) if memo is not None else None
    if parts is None:
        parts = _fsdp_parts(summary, cluster, mine, degrees, tp_size, ep_size, shard, expert_shard, param_item,
                            reduce_item, stages_per_rank, spans, intra)
        if memo is not None:
            memo[memo_key] = parts
    if shard in cluster.fsdp_unit:
        return parts
    first, ag, rs = parts
    if degrees["pp"] > 1:
        fwd_mb = compute / microbatches / 3  # one microbatch's forward (about a third of its forward + backward)
        return first + max(0.0, ag - first - fwd_mb) + max(0.0, rs - 2 * fwd_mb)
    return first + max(0.0, ag + rs - first - compute)


def _fsdp_parts(summary, cluster, mine, degrees, tp_size, ep_size, shard, expert_shard, param_item, reduce_item,
                stages_per_rank, spans, intra):
    """:func:`_fsdp_time`'s sums: the measured per-unit total (calibrated CPU world), else (the first gather,
    all gathers, all reduce-scatters) in seconds."""
    g = summary.groups
    dp = degrees["dp"]
    pp = degrees["pp"]
    span = spans["fsdp"]
    ct = cluster.collective_time
    gathers = 1 if pp > 1 else 2
    if shard in cluster.fsdp_unit:  # measured per-unit cost (hooks + latencies) + bandwidth
        bw_only = lambda kind, nbytes, group_size: (ct(kind, nbytes, group_size, intra(span))
                                                    - cluster.comm_by_size.get((kind, group_size), (0.0,))[0])
        # a unit per block and per stage root
        t = (sum(x["n"] for x in mine) + stages_per_rank) * cluster.fsdp_unit[shard]
        for x in mine:
            for k, cnt in x["kind_counts"].items():
                dense = g.kind_dense_bytes[k] / tp_size / summary.act_item
                expert = g.kind_expert_bytes[k] / (ep_size if ep_size > 1 else 1) / summary.act_item
                t += cnt * (2 * bw_only("all_gather", dense * param_item, shard)
                            + bw_only("reduce_scatter", dense * reduce_item, shard)
                            + 2 * ct("all_gather", expert * param_item, expert_shard, intra(span))
                            + ct("reduce_scatter", expert * reduce_item, expert_shard, intra(span)))
                if dp > 1:  # HSDP: the sharded gradients all_reduce over the replicas
                    t += cnt * ct("all_reduce", (dense + expert) / shard * reduce_item, dp,
                                  intra(spans["dp"]))
        if dp > 1:  # and the stage roots' gradients
            t += stages_per_rank * ct("all_reduce", 1.0, dp, intra(spans["dp"]))
        return t
    ag = rs = first = 0.0
    for x in mine:
        for k, cnt in x["kind_counts"].items():
            dense = g.kind_dense_bytes[k] / tp_size / summary.act_item
            expert = g.kind_expert_bytes[k] / (ep_size if ep_size > 1 else 1) / summary.act_item
            one_ag = (ct("all_gather", dense * param_item, shard, intra(span))
                      + ct("all_gather", expert * param_item, expert_shard, intra(span)))
            one_rs = (ct("reduce_scatter", dense * reduce_item, shard, intra(span))
                      + ct("reduce_scatter", expert * reduce_item, expert_shard, intra(span)))
            if dp > 1:  # HSDP: the sharded gradients all_reduce over the replicas
                one_rs += ct("all_reduce", (dense + expert) / shard * reduce_item, dp, intra(spans["dp"]))
            ag += cnt * gathers * one_ag
            rs += cnt * one_rs
            first = first or one_ag
    return first, ag, rs
