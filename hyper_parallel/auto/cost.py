"""Cost model: per-rank memory and step time of one candidate layout (equations: docs/auto_parallel.md).

Everything here is arithmetic on a :class:`ModelSummary` (built once per ``plan()`` call from the meta
trace), so one candidate costs microseconds and thousands are scored in well under a second.

On a calibrated CPU world (``Cluster.measure()`` found host costs) the step also pays the library's host
work, counted from the trace (:class:`HostCounts`): aten ops, ops dispatched on DTensors, AdamW's
per-parameter steps, ``fully_shard`` units, and each collective's measured per-call time at its group size.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch

from hyper_parallel.auto.memory import ParamGroups, group_params, shard_degrees, split_layers, state_bytes_per_stage
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

    @property
    def n_layers(self):
        return len(self.blk_fwd)


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
    inside = lambda f, b: f == b or f.startswith(b + ".")
    block_of = lambda f: next((i for i, b in enumerate(info.block_names) if inside(f, b)), None)
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
    moe = lambda m: any(inside(m, k) for k in info.moe_modules)
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
    for name in info.block_names:
        blk_fwd.append(mods[name].fwd_flops / b if name in mods else 0.0)
        exp = sum(t.fwd_flops for f, t in mods.items() if f.startswith(name + ".")
                  and info.module_roles.get(f) == "experts")
        blk_exp.append(exp / b)
        blk_attn.append(sum(mods[a].sdpa_flops for a in info.attention_modules if a.startswith(name + ".")) / b)
        inner = outer = gathered = 0
        for f, t in mods.items():
            if f == name or f.startswith(name + "."):
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
        blk_ops.append(sum(t.ops for f, t in mods.items() if f == name or f.startswith(name + ".")))
    in_blocks = lambda f: any(f == n or f.startswith(n + ".") for n in info.block_names)
    emb = {k for k, v in info.module_roles.items() if v == "embedding"}
    first = sum(t.saved_bytes for f, t in mods.items() if f in emb) / b
    last = sum(t.saved_bytes for f, t in mods.items() if not in_blocks(f) and f not in emb) / b
    head = max(trace.fwd_flops / b - sum(blk_fwd), 0.0)
    item = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    bufs = sum(x.numel() * x.element_size() for x in model.buffers())
    return ModelSummary(info, group_params(info), trace.seq_len, item, blk_fwd, blk_exp, blk_attn, head,
                        trace.bwd_flops / max(trace.fwd_flops, 1), blk_in, blk_out, first, last, bufs, blk_gat,
                        blk_ops, max(trace.fwd_ops - sum(blk_ops), 0), trace.bwd_ops / max(trace.fwd_ops, 1),
                        host_counts(info, trace))


@dataclasses.dataclass
class Candidate:
    degrees: Dict[str, int]
    sp: bool
    ac: str
    schedule: str = None
    microbatches: int = 1
    cp_method: str = None


def _span(order, sizes, dim):
    """Contiguous ranks one group of ``dim`` spans (mesh order row-major): its size x the inner dims' sizes."""
    i = order.index(dim)
    span = 1
    for d in order[i:]:
        span *= sizes[d]
    return span


def _stages(ms: ModelSummary, n_stage_modules: int):
    """Per stage module: aggregates of its blocks (cached per split)."""
    cache = ms.__dict__.setdefault("_stage_cache", {})
    if n_stage_modules in cache:
        return cache[n_stage_modules]
    g = ms.groups
    out = []
    for idx in split_layers(ms.n_layers, n_stage_modules):
        kinds = sorted({g.block_kind[i] for i in idx})
        rep = {k: next(i for i in idx if g.block_kind[i] == k) for k in kinds}
        out.append(dict(
            blocks=idx, n=len(idx),
            fwd=sum(ms.blk_fwd[i] for i in idx), exp=sum(ms.blk_expert_fwd[i] for i in idx),
            attn=sum(ms.blk_attn_fwd[i] for i in idx), inner=sum(ms.blk_inner[i] for i in idx),
            outer=sum(ms.blk_outer[i] for i in idx), gathered=sum(ms.blk_gathered[i] for i in idx),
            reps=[(ms.blk_inner[rep[k]], ms.blk_outer[rep[k]], ms.blk_gathered[rep[k]]) for k in kinds],
            kind_counts={k: sum(1 for i in idx if g.block_kind[i] == k) for k in kinds},
            n_moe=sum(1 for i in idx if ms.info.block_is_moe[i]), ops=sum(ms.blk_ops[i] for i in idx),
        ))
    cache[n_stage_modules] = out
    return out


def tp_collectives(hc: HostCounts, blocks, sp: bool, full_ac: bool, first: bool, last: bool) -> Dict[tuple, int]:
    """TP collectives of one microbatch's forward + backward: ``{(kind, "act" | "logits"): count}``.

    Per site (attention, MLP), with SP: all_gather in, reduce_scatter out, the reverse in backward; without:
    all_reduce out, all_reduce of the input gradient. Activation checkpointing recomputes a block's forward
    but stops after its last saved tensor (the last site's output collective is not redone). The embedding
    (RowwiseParallel) reduces its output (SP: reduce_scatter, gradient all_gather); the head
    (ColwiseParallel, replicated logits) all_gathers the logits and reduces its input gradient (SP: it also
    gathers its sequence-sharded input)."""
    sites = sum(hc.sites[i] for i in blocks)
    re_sites = sum(max(hc.sites[i] - 1, 0) for i in blocks) if full_ac else 0
    out = {}
    if sp:
        out[("all_gather", "act")] = 2 * sites + (sites if full_ac else 0) + int(first) + int(last)
        out[("reduce_scatter", "act")] = 2 * sites + re_sites + int(first) + int(last)
    else:
        out[("all_reduce", "act")] = 2 * sites + re_sites + int(first) + int(last)
    if last:
        out[("all_gather", "logits")] = 1
    return out


def blocks_of(stages):
    return [i for x in stages for i in x["blocks"]]


def _host_time(ms, cluster, c, st_ids, blocks, nsm, m, tp, shard):
    """Seconds of host work beyond the aten ops: ops dispatched on DTensors (TP, SP norms; again when
    activation checkpointing recomputes them) and AdamW's per-parameter steps (on DTensors when sharded)."""
    hc = ms.host
    top = 0 in st_ids or (nsm - 1) in st_ids
    sp = c.sp and tp > 1
    n_all = sum(hc.p_all[i] for i in blocks) + (hc.top_p_all if top else 0)
    t = 0.0
    if tp > 1:
        dt = sum(hc.dt_tp[i] + (hc.dt_norm[i] if sp else 0) for i in blocks)
        dt_top = hc.top_dt_tp + (hc.top_dt_norm if sp else 0) if top else 0
        t += m * ((2 if c.ac in ("full", "selective") else 1) * dt + dt_top) * cluster.dtensor_op
    if shard > 1:  # fully_shard: every parameter is a DTensor
        n_dt = n_all
    elif tp > 1:
        n_dt = sum(hc.p_tp[i] + (hc.p_norm[i] if sp else 0) for i in blocks)
        n_dt += (hc.top_p_tp + (hc.top_p_norm if sp else 0)) if top else 0
    else:
        n_dt = 0
    plain, dtensor = cluster.optim
    return t + n_dt * dtensor + (n_all - n_dt) * plain


def evaluate(ms: ModelSummary, cluster, c: Candidate, *, global_batch: int, optimizer: str, param_item: int,
             reduce_item: int):
    """-> (Memory, StepTime, layers per stage module) of candidate ``c``."""
    d = c.degrees
    dp, fsdp, tp, pp, cp, ep = (d[k] for k in ("dp", "fsdp", "tp", "pp", "cp", "ep"))
    info, g = ms.info, ms.groups
    v = STAGES_PER_RANK.get(c.schedule, 1) if pp > 1 else 1
    nsm = pp * v
    stages = _stages(ms, nsm)
    per_stage_state = state_bytes_per_stage(g, d, [st["blocks"] for st in stages], optimizer)
    b_local = global_batch // (dp * fsdp)
    m = c.microbatches if pp > 1 else 1
    b_mb = b_local / m
    sp_div = tp if c.sp else 1
    act_scale = param_item / ms.act_item  # activations in the compute dtype
    S = ms.seq_len
    hidden_bytes = S / cp * info.dim * param_item  # one sample's hidden state [S/cp, dim]
    shard, expert_shard = shard_degrees(d)
    if pp > 1:
        in_flight = {"gpipe": m, "1f1b": min(m, pp), "interleaved1f1b": min(m * v, pp * v + pp - 1) / v}[c.schedule]
    else:
        in_flight = 1
    worst_mem, worst = None, 0
    for r in range(pp):
        st_ids = [r + k * pp for k in range(v)]
        params = sum(per_stage_state[s][0] for s in st_ids)
        opt = sum(per_stage_state[s][2] for s in st_ids)
        ntens = sum(per_stage_state[s][3] for s in st_ids)
        nblk = sum(stages[s]["n"] for s in st_ids)
        if c.ac == "full":
            biggest = max(((i / tp + o / sp_div + gg) for s in st_ids for i, o, gg in stages[s]["reps"]), default=0)
            per_sample = nblk * hidden_bytes / sp_div / act_scale + biggest / cp
        elif c.ac == "selective":  # hyper_parallel.auto.selective_ac: inputs + matmul/attention outputs per block
            from hyper_parallel.auto.selective_ac import selective_per_sample
            per_sample = selective_per_sample(ms, [stages[s] for s in st_ids], tp, sp_div, cp,
                                              hidden_bytes / act_scale)
        else:
            per_sample = sum(stages[s]["inner"] / tp + stages[s]["outer"] / sp_div + stages[s]["gathered"]
                             for s in st_ids) / cp
        if 0 in st_ids:
            per_sample += ms.first_saved / sp_div / cp
        if nsm - 1 in st_ids:
            per_sample += ms.last_saved / cp
        acts = per_sample * act_scale * b_mb * in_flight
        # communication buffers: FSDP all-gather (this block + the prefetched next) and reduce-scatter input,
        # or a replicated model's flat gradient all_reduce buffer; the optimizer's 4-byte step scalars
        kinds = {k for s in st_ids for k in stages[s]["kind_counts"]}
        blk = max((g.kind_dense_bytes[k] / tp + g.kind_expert_bytes[k] / (ep if ep > 1 else 1) for k in kinds),
                  default=0) / ms.act_item
        if shard > 1:
            bufs = blk * (2 * param_item + reduce_item)
        elif dp * cp > 1:  # the flat gradient all_reduce runs after backward, when the activations are gone
            bufs = max(0.0, params * reduce_item / ms.act_item - acts)
        else:
            bufs = 0
        bufs += 4 * ntens + ms.model_buffers
        mem = Memory(int(params), int(params), int(opt), int(acts), int(bufs))
        if worst_mem is None or mem.total > worst_mem.total:
            worst_mem, worst = mem, r
    # ---------------------------------------------------------------- time (the slowest stage's rank)
    order = ["pp", "dp", "fsdp", "cp", "tp"]
    sizes = {"pp": pp, "dp": dp, "fsdp": fsdp, "cp": cp, "tp": tp}
    dpn = cluster.devices_per_node
    intra = lambda span: span <= dpn
    ct = cluster.collective_time
    st_ids = [worst + k * pp for k in range(v)]
    mine = [stages[s] for s in st_ids]
    nblk = sum(x["n"] for x in mine)
    n_moe = sum(x["n_moe"] for x in mine)
    fwd = sum(x["fwd"] - x["exp"] for x in mine) / (tp * cp) + sum(x["exp"] for x in mine) / cp
    last = (nsm - 1) in st_ids
    if last or pp == 1:
        fwd += ms.head_fwd / (tp * cp)
    recompute = sum(x["fwd"] for x in mine) / (tp * cp) if c.ac == "full" else 0.0
    compute = b_local * (fwd * (1 + ms.bwd_ratio) + recompute) / cluster.flops
    if cluster.op_overhead:  # host time per operator (eager CPU runs): forward, backward and recomputed ops
        ops = sum(x["ops"] for x in mine) + (ms.head_ops if last or pp == 1 else 0)
        re_ops = sum(x["ops"] for x in mine) if c.ac in ("full", "selective") else 0
        compute += m * (ops * (1 + ms.bwd_op_ratio) * cluster.op_overhead
                        + re_ops * (cluster.ac_op or cluster.op_overhead))
    comm: Dict[str, float] = {}
    hc = ms.host
    blocks = blocks_of(mine)
    if cluster.op_overhead:  # CPU world: the library's host work (calibrated by Cluster.measure())
        compute += _host_time(ms, cluster, c, st_ids, blocks, nsm, m, tp, shard)
    first = 0 in st_ids
    full_ac = c.ac in ("full", "selective")  # both rerun the forward's TP collectives in backward
    if tp > 1:  # TP / SP per microbatch: the collectives the library's styles issue (docs/auto_parallel.md)
        a = b_mb * hidden_bytes
        span = _span(order, sizes, "tp")
        logits = b_mb * S / cp * info.vocab * param_item
        size = {"act": a, "logits": logits}
        t = sum(cnt * ct(kind, size[what], tp, intra(span))
                for (kind, what), cnt in tp_collectives(hc, blocks, c.sp, full_ac, first, last).items())
        comm["tp"] = t * m
        if c.sp:  # the SP norms' replicated weights: one all_reduce of their gradients per step
            comm["tp"] += ct("all_reduce", 4 * info.dim * (sum(hc.p_norm[i] for i in blocks) + hc.top_p_norm), tp,
                             intra(span))
    if cp > 1:  # CP: ring K/V p2p overlapped with attention compute, or Ulysses all_to_all (q, k, v, out)
        span = _span(order, sizes, "cp")
        if c.cp_method == "ring":
            kv = 2 * b_mb * S / cp * info.n_kv_heads / tp * info.head_dim * param_item
            ring = 3 * (cp - 1) * ct("p2p", kv, 2, intra(span)) * nblk * m
            attn = sum(x["attn"] for x in mine) / (tp * cp) * 3 * b_local / cluster.flops
            comm["cp"] = max(0.0, ring - attn)
        else:
            a = b_mb * S / cp * info.dim / tp * param_item
            comm["cp"] = 8 * ct("all_to_all", a, cp, intra(span)) * nblk * m
    if ep > 1 and n_moe:  # EP: dispatch + combine all_to_all, forward and backward
        rows = b_mb * S / cp * info.top_k * info.dim * param_item
        comm["ep"] = 4 * ct("all_to_all", rows, ep, intra(ep * cp * tp)) * n_moe * m
    if shard > 1 and shard in cluster.fsdp_unit:  # measured per-unit cost (hooks + latencies) + bandwidth
        span = _span(order, sizes, "fsdp")
        bw_only = lambda kind, nb, n: ct(kind, nb, n, intra(span)) - cluster.comm_by_size.get((kind, n), (0.0,))[0]
        t = (nblk + v) * cluster.fsdp_unit[shard]  # a fully_shard unit per block and per stage root
        for x in mine:
            for k, cnt in x["kind_counts"].items():
                dense = g.kind_dense_bytes[k] / tp / ms.act_item
                expert = g.kind_expert_bytes[k] / (ep if ep > 1 else 1) / ms.act_item
                t += cnt * (2 * bw_only("all_gather", dense * param_item, shard)
                            + bw_only("reduce_scatter", dense * reduce_item, shard)
                            + 2 * ct("all_gather", expert * param_item, expert_shard, intra(span))
                            + ct("reduce_scatter", expert * reduce_item, expert_shard, intra(span)))
                if dp > 1:  # HSDP: the sharded gradients all_reduce over the replicas
                    t += cnt * ct("all_reduce", (dense + expert) / shard * reduce_item, dp,
                                  intra(_span(order, sizes, "dp")))
        if dp > 1:  # and the stage roots' gradients
            t += v * ct("all_reduce", 1.0, dp, intra(_span(order, sizes, "dp")))
        comm["fsdp"] = t  # gloo on the cores that compute: nothing overlaps
    elif shard > 1:  # FSDP: all_gather fwd + bwd, reduce_scatter per block; prefetch hides all but the first
        span = _span(order, sizes, "fsdp")
        total = first = 0.0
        for x in mine:
            for k, cnt in x["kind_counts"].items():
                dense = g.kind_dense_bytes[k] / tp / ms.act_item
                expert = g.kind_expert_bytes[k] / (ep if ep > 1 else 1) / ms.act_item
                one = (2 * ct("all_gather", dense * param_item, shard, intra(span))
                       + ct("reduce_scatter", dense * reduce_item, shard, intra(span))
                       + 2 * ct("all_gather", expert * param_item, expert_shard, intra(span))
                       + ct("reduce_scatter", expert * reduce_item, expert_shard, intra(span)))
                total += cnt * one
                first = first or one / 3
                if dp > 1:  # HSDP: the sharded gradients all_reduce over the replicas
                    total += cnt * ct("all_reduce", (dense + expert) / shard * reduce_item, dp,
                                      intra(_span(order, sizes, "dp")))
        comm["fsdp"] = first + max(0.0, total - first - compute)
    elif dp * cp > 1:  # replicated: one flat gradient all_reduce after backward
        span = _span(order, sizes, "dp") if dp > 1 else _span(order, sizes, "cp")
        comm["dp"] = ct("all_reduce", worst_mem.params * reduce_item / ms.act_item, dp * cp, intra(span))
    bubble = 0.0
    if pp > 1:
        span = _span(order, sizes, "pp")
        p2p = ct("p2p", b_mb * hidden_bytes / sp_div, 2, intra(span))
        comm["pp"] = 2 * (pp - 1) * p2p
        bubble = (compute + sum(comm.values())) * (pp - 1) / (m * v)
    st = StepTime(compute, sum(comm.values()), bubble, comm)
    return worst_mem, st, [x["n"] for x in stages]
