"""hyper_parallel.auto: is the planner right, and fast?  (docs/auto_parallel.md, docs/performance.md)

    .venv/bin/python benchmarks/bench_auto_parallel.py            # everything (~10 min on 2 busy cores)
    .venv/bin/python benchmarks/bench_auto_parallel.py paper speed memory dryrun ranking   # a subset

* speed:   plan() for a 70B-class dense Llama and a DeepSeek-V3-class MoE on the meta device at world 1024
           (8 per node, 80 GiB): seconds, and the top plan's predicted memory.
* memory:  on 4 gloo ranks, for plans of the example Llama (dense and MoE: fsdp, hsdp, dp, tp+sp, cp, ep, AC none/full/selective),
           predicted parameter + gradient + optimizer bytes vs the measured local shards (max over ranks) and
           the predicted per-rank peak vs the measured one (parameters + buffers + the step's peak of new storages).
* dryrun:  dry_run at world 8 vs the same step on 8 real gloo ranks (peak, collective list with bytes), and
           dry_run at world 256 (tiny config) wall time.
* paper:   one process, meta device: every row of Megatron-LM's Table 1 and Llama 3's Table 4 (benchmarks/paper_runs.py):
           the published layout's predicted TFLOP/s per GPU (FLOPs counted the paper's way) vs the published figure,
           its per-rank memory and whether it fits 80 GB. `paper plan=1` also runs plan() on each model and cluster.
* ranking: on 4 ranks, calibrated with Cluster.measure(), every plan that Plan.apply runs for the tiny and demo
           configs is timed (warm-up steps, then rounds of steps interleaved over the plans); table of predicted
           vs measured (median, min, spread) step time and ranks, Spearman rho, top pick vs fastest.
           Options: `ranking rounds=7 steps=2 warmup=2 configs=tiny,demo` (about 3-4 minutes on 2 cores).
"""
from __future__ import annotations

import statistics
import sys
import time

from common import ROOT, launch, table  # noqa: F401  (ROOT puts the repo on sys.path)

import torch
import torch.distributed as dist

MEM_LAYOUTS = [  # (config, degrees, sp, ac)
    ("tiny", {"fsdp": 4}, False, "none"),
    ("tiny", {"dp": 4}, False, "none"),
    ("tiny", {"dp": 2, "fsdp": 2}, False, "none"),
    ("tiny", {"fsdp": 2, "tp": 2}, True, "none"),
    ("tiny", {"dp": 2, "tp": 2}, False, "none"),
    ("tiny", {"fsdp": 2, "tp": 2}, True, "full"),
    ("demo", {"fsdp": 4}, False, "none"),
    ("demo", {"fsdp": 4}, False, "full"),
    ("demo", {"tp": 4}, True, "none"),
    ("demo", {"fsdp": 2, "tp": 2}, False, "none"),
    ("moe-tiny", {"fsdp": 4, "ep": 2}, False, "none"),
    ("moe-tiny", {"fsdp": 4, "ep": 4}, False, "full"),
    ("moe-demo", {"fsdp": 2, "tp": 2}, True, "none"),
    ("tiny", {"fsdp": 2, "cp": 2}, False, "none"),          # context parallel (the planner's cp method)
    ("demo", {"dp": 2, "cp": 2}, False, "full"),
    ("demo", {"fsdp": 4}, False, "selective"),               # selective AC
    ("demo", {"fsdp": 2, "tp": 2}, True, "selective"),
    ("tiny", {"pp": 2, "fsdp": 2}, False, "1f1b"),        # pipelines: the last field is the schedule
    ("demo", {"pp": 2, "fsdp": 2}, False, "gpipe"),
    ("demo", {"pp": 2, "fsdp": 2}, False, "interleaved1f1b"),
]


def _meta(name):
    from examples.llama.configs import get_config
    from examples.llama.model import Transformer
    cfg = get_config(name)
    with torch.device("meta"):
        return cfg, Transformer(cfg.model, init_seed=None)


def _builder(cfg):
    from examples.llama.model import build_model
    return lambda: build_model(cfg.model, cfg.seed)


# ------------------------------------------------------------------ speed
def bench_speed():
    from examples.llama.model import ModelArgs, Transformer
    from examples.llama.moe import MoEArgs
    from hyper_parallel.auto import Cluster, plan
    models = {
        "llama-70b": (ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                                ffn_dim_multiplier=1.3, max_seq_len=8192, rope_theta=500000.0), 1024, 8192),
        "deepseek-v3-class": (ModelArgs(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280,
                                        multiple_of=256, max_seq_len=4096, n_dense_layers=3,
                                        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=2048, n_shared_experts=1,
                                                    score_func="sigmoid", route_norm=True, n_groups=8, topk_groups=4)),
                              4096, 4096),
    }
    rows = []
    for name, (args, gb, s) in models.items():
        with torch.device("meta"):
            m = Transformer(args, init_seed=None)
        n = sum(p.numel() for p in m.parameters())
        t0 = time.perf_counter()
        ps = plan(m, Cluster(1024, 8, "80GiB"), global_batch=gb, seq_len=s, param_dtype=torch.bfloat16,
                  reduce_dtype=torch.float32)
        took = time.perf_counter() - t0
        rows.append((name, f"{n / 1e9:.1f} B", f"{gb}x{s}", f"{took:.2f}", ps[0].summary(),
                     f"{ps[0].memory.total / 2**30:.1f}", f"{ps[0].step_time.total:.2f}"))
    print("\n## plan() speed at world 1024 (8 per node, 80 GiB, bf16 compute / fp32 reduce)\n")
    print(table(["model", "params", "batch", "plan() s", "top plan", "GiB/rank", "pred. step s"], rows))


# ------------------------------------------------------------------ memory
def _mem_body():
    from hyper_parallel.auto import Cluster, evaluate_plan
    from hyper_parallel.auto.dry_run import measure_step
    out = []
    for name, deg, sp, ac in MEM_LAYOUTS:
        cfg, meta = _meta(name)
        sched = ac if deg.get("pp", 1) > 1 else None
        p = evaluate_plan(meta, Cluster(4, 4, "1GiB"), degrees=deg, global_batch=cfg.global_batch,
                          seq_len=cfg.seq_len, sequence_parallel=sp, activation_checkpointing="none" if sched else ac,
                          pp_schedule=sched, microbatches=2 if sched else None)
        rep = measure_step(p, _builder(cfg))
        v = torch.tensor([rep.state_bytes, rep.peak_memory], dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        out.append((name, p.summary(), p.state_max, int(v[0]), p.memory.total, int(v[1])))
        dist.barrier()
    return out


def bench_memory():
    rows = []
    for name, summ, ps, ms, pt, mt in launch(4, _mem_body):
        rows.append((name, summ, f"{ps:,}", f"{ms:,}", "yes" if ps == ms else "NO", f"{pt / 2**20:.2f}",
                     f"{mt / 2**20:.2f}", f"{pt / mt:.2f}"))
    print("\n## memory: predicted vs measured per rank (max over 4 gloo ranks)\n")
    print(table(["config", "plan", "pred. state B", "meas. state B", "exact", "pred. peak MiB", "meas. peak MiB",
                 "pred/meas"], rows))


# ------------------------------------------------------------------ dry run
def _dry_plan(world, name="tiny", deg=None, gb=None):
    from hyper_parallel.auto import Cluster, evaluate_plan
    cfg, meta = _meta(name)
    deg = deg or {"fsdp": world // 2, "tp": 2}
    return cfg, evaluate_plan(meta, Cluster(world, 8, "1GiB"), degrees=deg, global_batch=gb or cfg.global_batch,
                              seq_len=cfg.seq_len, sequence_parallel=True)


def _dry_body():
    from hyper_parallel.auto.dry_run import measure_step
    cfg, p = _dry_plan(8)
    rep = measure_step(p, _builder(cfg))
    allr = [None] * dist.get_world_size()
    dist.all_gather_object(allr, (rep.rank, rep.peak_memory, rep.collectives))
    return allr


def bench_dryrun():
    from hyper_parallel.auto import dry_run
    cfg, p = _dry_plan(8)
    t0 = time.perf_counter()
    fake = dry_run(p, _builder(cfg), world_size=8)
    t_fake = time.perf_counter() - t0
    real = {r: (peak, coll) for r, peak, coll in launch(8, _dry_body)}
    rows = []
    for r, rep in fake.ranks.items():
        peak, coll = real[r]
        rows.append((r, rep.role, f"{rep.peak_memory:,}", f"{peak:,}", f"{rep.peak_memory / peak:.3f}",
                     len(rep.collectives), "yes" if rep.collectives == coll else "NO"))
    print(f"\n## dry run at world 8 ({p.summary()}, tiny) vs 8 real gloo ranks; dry run took {t_fake:.1f}s\n")
    print(table(["rank", "role", "dry-run peak B", "real peak B", "ratio", "collectives", "same list+bytes"], rows))
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(1) as pool:  # one dry-run world size per process
        took, summ, ranks, peak, pred, ncoll = pool.apply(_dry_256)
    print(f"\ndry run at world 256 ({summ}, tiny config, batch 256): {took:.1f}s for ranks {ranks}; peak "
          f"{peak / 2**20:.2f} MiB, predicted {pred / 2**20:.2f} MiB, {ncoll} collectives on rank 0")


def _dry_256():
    from hyper_parallel.auto import dry_run
    torch.set_num_threads(1)
    cfg, p = _dry_plan(256, deg={"fsdp": 128, "tp": 2}, gb=256)
    t0 = time.perf_counter()
    big = dry_run(p, _builder(cfg), world_size=256)
    took = time.perf_counter() - t0
    return took, p.summary(), sorted(big.ranks), big.peak_memory, p.memory.total, len(big.ranks[0].collectives)


# ------------------------------------------------------------------ ranking
def _one_step(model, opt, x, y):
    from hyper_parallel.auto.dry_run import _loss
    opt.zero_grad(set_to_none=True)
    _loss(model(x), y).backward()
    opt.step()


def _rank_body(name, rounds, steps, warmup):
    """Every rank: calibrate, plan, build every plan, then time them round-robin (each round starts at the next
    plan, so drift and position hit all plans alike); a round times ``steps`` steps of each plan (max over ranks)."""
    from hyper_parallel.auto import Cluster, plan
    from hyper_parallel.auto.dry_run import _default_batch
    cfg, meta = _meta(name)
    t0 = time.perf_counter()
    cluster = Cluster(4, 4, "1GiB").measure()
    t_measure = time.perf_counter() - t0
    plans = plan(meta, cluster, global_batch=cfg.global_batch, seq_len=cfg.seq_len,
                 parallelisms=("dp", "fsdp", "tp", "sp", "ep"), top_k=1000)
    runs = []
    for p in plans:
        model = p.apply(_builder(cfg)())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = _default_batch(p, dist.get_rank(), cfg.model.vocab_size)
        for _ in range(warmup):
            _one_step(model, opt, x, y)
        runs.append((p, model, opt, x, y, []))
    n = len(runs)
    for r in range(rounds):
        for k in range(n):
            p, model, opt, x, y, per_round = runs[(r + k) % n]
            dist.barrier()
            t = torch.zeros(1, dtype=torch.float64)
            for _ in range(steps):
                t0 = time.perf_counter()
                _one_step(model, opt, x, y)
                t += time.perf_counter() - t0
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            per_round.append(t.item() / steps)
    cal = dict(flops=cluster.flops, op=cluster.op_overhead, ac_op=cluster.ac_op, dtensor_op=cluster.dtensor_op,
               optim=cluster.optim, fsdp_unit=cluster.fsdp_unit,
               comm={f"{k[0]}@{k[1]}": v for k, v in cluster.comm_by_size.items()}, took=t_measure)
    return cal, [(p.summary(), p.step_time.total, p.step_time.compute, dict(p.step_time.comm_per_dim), rounds_)
                 for p, _, _, _, _, rounds_ in runs]


def _ranks(v):
    order = sorted(range(len(v)), key=lambda i: v[i])
    r = [0] * len(v)
    for k, i in enumerate(order):
        r[i] = k + 1
    return r


def _spearman(a, b):
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def bench_ranking(configs=("tiny", "demo"), rounds=7, steps=2, warmup=2):
    """Table per config: plan (planner order), predicted step (compute + comm), measured min over rounds (each
    round: the mean of ``steps`` steps, max over ranks; other jobs only add time), median, spread ((max - min) /
    min over rounds), predicted and measured rank; Spearman rho and the top pick's measured / the fastest's
    (from the mins; also from the medians)."""
    summary = []
    for name in configs:
        t0 = time.perf_counter()
        cal, res = launch(4, _rank_body, name, rounds, steps, warmup)
        took = time.perf_counter() - t0
        med = [statistics.median(r[4]) for r in res]
        mins = [min(r[4]) for r in res]  # the measured figure: other jobs on the machine only ever add time
        spread = [(max(r[4]) - min(r[4])) / m for r, m in zip(res, mins)]
        pred = [r[1] for r in res]
        rp, rm = _ranks(pred), _ranks(mins)
        fastest = min(mins)
        rows = [(i + 1, r[0], f"{r[1] * 1e3:.1f}", f"{r[2] * 1e3:.1f}",
                 " ".join(f"{k}={v * 1e3:.1f}" for k, v in r[3].items()) or "-", f"{mins[i] * 1e3:.1f}",
                 f"{med[i] * 1e3:.1f}", f"{spread[i] * 100:.0f}%", rp[i], rm[i], f"{mins[i] / fastest:.2f}")
                for i, r in enumerate(res)]
        rho, rho_med = _spearman(pred, mins), _spearman(pred, med)
        top, top_med = mins[0] / fastest, med[0] / min(med)
        summary.append((name, len(res), f"{rho:.2f}", f"{top:.2f}", f"{rho_med:.2f}", f"{top_med:.2f}",
                        f"{statistics.median(spread) * 100:.0f}%", f"{took:.0f}"))
        comm = "; ".join(f"{k} {a * 1e6:.0f} us + B/{bw / 1e6:.0f} MB/s" for k, (a, bw) in sorted(cal["comm"].items()))
        print(f"\n## ranking on 4 gloo ranks, config {name}: {len(res)} plans in planner order; {rounds} rounds x "
              f"{steps} steps each, interleaved\n")
        print(f"calibration (Cluster.measure(), {cal['took']:.1f}s): matmul {cal['flops'] / 1e9:.1f} GFLOP/s per "
              f"rank; aten op {cal['op'] * 1e6:.1f} us; +{cal['ac_op'] * 1e6:.1f} us per checkpointed forward op; "
              f"DTensor op +{cal['dtensor_op'] * 1e6:.1f} us; AdamW per parameter {cal['optim'][0] * 1e6:.0f} us plain, "
              f"{cal['optim'][1] * 1e6:.0f} us DTensor; fully_shard unit "
              + ", ".join(f"{v * 1e3:.2f} ms at {k}" for k, v in sorted(cal["fsdp_unit"].items()))
              + f"; collectives: {comm}\n")
        print(table(["#", "plan", "pred. ms", "pred. compute", "pred. comm per dim", "meas. ms (min)",
                     "meas. median", "spread", "pred. rank", "meas. rank", "meas./fastest"], rows))
        print(f"\nSpearman rho (predicted vs measured min) {rho:.2f}, top pick {top:.2f}x the fastest measured plan "
              f"({res[rm.index(1)][0]}); with the medians: rho {rho_med:.2f}, top pick {top_med:.2f}x")
    print("\n## ranking summary (acceptance: rho >= 0.7, top pick <= 1.15x; measured = min over rounds)\n")
    print(table(["config", "plans", "Spearman rho", "top pick / fastest", "rho (medians)", "top pick (medians)",
                 "median spread", "wall s"], summary))


# ------------------------------------------------------------------ paper
# activation checkpointing from the lightest: none, selective, full on the first k blocks of every stage, full
LIGHTEST_FIRST = [("none", None), ("selective", None), ("full", 1), ("full", 2), ("full", 3), ("full", None)]


def _paper_layouts():
    """(name, model factory, cluster, evaluate_plan kwargs, paper FLOPs per step, published TFLOP/s per GPU,
    AC choices in order) for every published row (benchmarks/paper_runs.py)."""
    import paper_runs as pr
    from hyper_parallel.auto import Cluster
    out = []
    for P, heads, h, layers, tp, pp, n, batch, pub in pr.MEGATRON_TABLE1:
        dp = n // (tp * pp)
        kw = dict(degrees=dict(dp=dp, tp=tp, pp=pp), global_batch=batch, seq_len=2048)
        if pp > 1:  # PipeDream-Flush (1F1B), microbatches of one sequence
            kw.update(pp_schedule="1f1b", microbatches=batch // dp)
        out.append((f"Megatron {P:g}B", lambda h=h, heads=heads, layers=layers: pr.gpt(h, heads, layers),
                    Cluster.preset("a100", n), kw, pr.megatron_flops(batch, 2048, layers, h), pub, [("full", None)]))
    for n, tp, cp, pp, dp, seq, pub in pr.LLAMA3_TABLE4:
        batch = pr.LLAMA3_TOKENS // seq
        kw = dict(degrees=dict(fsdp=dp, tp=tp, pp=pp, cp=cp), global_batch=batch, seq_len=seq, sequence_parallel=True,
                  pp_schedule="interleaved1f1b", stages_per_rank=4, microbatches=batch // dp,
                  cp_method="ring" if cp > 1 else None)
        # 8K: trained without activation checkpointing (the paper); 128K: not published, the lightest that fits
        acs = [("none", None)] if seq <= 8192 else LIGHTEST_FIRST
        out.append((f"Llama 3 405B {seq // 1024}K", lambda seq=seq: pr.llama_405b(seq), Cluster.preset("h100", n), kw,
                    None, pub, acs))
    return out


def bench_paper(with_plan=False):
    """Published training runs: the predicted TFLOP/s per GPU of the published layout (FLOPs counted the
    paper's way) against the published figure, and the per-rank memory (fits 80 GB?)."""
    import paper_runs as pr
    from hyper_parallel.auto import Cluster, evaluate_plan, plan
    rows, plan_rows = [], []
    for name, make, cluster, kw, flops, pub, acs in _paper_layouts():
        model = make()
        if flops is None:
            flops = pr.llama3_flops(pr.LLAMA3_TOKENS, kw["seq_len"], pr.n_params(model))
        t0 = time.perf_counter()
        ev = lambda ac, k: evaluate_plan(model, cluster, activation_checkpointing=ac, recompute_layers=k,
                                         param_dtype=torch.bfloat16, reduce_dtype=torch.float32, **kw)
        for ac, k in acs:  # the paper's AC (or, not published, the lightest that fits)
            p = ev(ac, k)
            if p.fits:
                break
        took = time.perf_counter() - t0
        here = p
        for ac, k in LIGHTEST_FIRST[LIGHTEST_FIRST.index((p.activation_checkpointing, p.recompute_layers)):]:
            here = ev(ac, k)
            if here.fits:
                break
        pred = flops / p.step_time.total / cluster.world_size / 1e12
        t = p.step_time
        rows.append((name, cluster.world_size, p.summary(), p.summary().split("ac:")[-1] if "ac:" in p.summary()
                     else "none", pub, f"{pred:.0f}",
                     f"{pred / pub:.2f}", "yes" if abs(pred / pub - 1) <= 0.15 else "NO",
                     f"{p.memory.total / 2**30:.1f}", "yes" if p.fits else "NO",
                     f"{here.summary().split('ac:')[-1] if 'ac:' in here.summary() else 'none'}: "
                     f"{here.memory.total / 2**30:.1f}" if here.fits else "none fits",
                     f"{t.compute:.2f}", f"{t.comm:.2f}", f"{t.bubble:.2f}", f"{p.mfu:.1%}", f"{took:.2f}"))
        if with_plan:
            t0 = time.perf_counter()
            best = plan(model, cluster, global_batch=kw["global_batch"], seq_len=kw["seq_len"],
                        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, top_k=50)
            took = time.perf_counter() - t0
            mx = max(x.mfu for x in best)
            plan_rows.append((name, best[0].summary(), f"{best[0].step_time.total:.2f}", f"{t.total:.2f}",
                              "yes" if best[0].step_time.total <= t.total * (1 + 1e-9) else "NO", f"{best[0].mfu:.1%}",
                              f"{mx:.1%}", f"{took:.1f}"))
    sweep = []  # Megatron-LM Table 2: PTD-P against ZeRO-3 on the same models as the GPUs grow
    for P, heads, h, layers, pp, n, batch, ptd, zero in pr.MEGATRON_TABLE2:
        model, cluster = pr.gpt(h, heads, layers), Cluster.preset("a100", n)
        flops = pr.megatron_flops(batch, 2048, layers, h)
        common = dict(global_batch=batch, seq_len=2048, activation_checkpointing="full", param_dtype=torch.bfloat16,
                      reduce_dtype=torch.float32)
        dp = n // (8 * pp)
        for scheme, kw, pub in (("PTD-P", dict(degrees=dict(dp=dp, tp=8, pp=pp), pp_schedule="interleaved1f1b",
                                                microbatches=batch // dp), ptd),
                                ("ZeRO-3 (fsdp)", dict(degrees=dict(fsdp=n)), zero)):
            if pub is None:
                continue
            p = evaluate_plan(model, cluster, **kw, **common)
            pred = flops / p.step_time.total / n / 1e12
            sweep.append((f"Megatron {P:g}B", n, scheme, p.summary(), pub, f"{pred:.0f}", f"{pred / pub:.2f}",
                          f"{p.memory.total / 2**30:.1f}", "yes" if p.fits else "NO"))
    print("\n## published runs: predicted vs published TFLOP/s per GPU (paper's FLOP count), memory per rank\n")
    print(table(["run", "GPUs", "layout (as evaluated)", "AC", "published", "predicted", "ratio", "within 15%",
                 "GiB/rank", "fits 80 GiB", "lightest AC that fits here: GiB", "compute s", "comm s", "bubble s",
                 "MFU (model)", "eval s"], rows))
    print("\n## Megatron-LM Table 2: PTD-P vs ZeRO-3 as the GPUs grow (TFLOP/s per GPU, the paper's count)\n")
    print(table(["model", "GPUs", "scheme", "layout (as evaluated)", "published", "predicted", "ratio", "GiB/rank",
                 "fits 80 GiB"], sweep))
    if with_plan:
        print("\n## the planner on the same models and clusters: top plan vs the published layout\n")
        print(table(["run", "top plan", "pred. step s", "published layout s", "top <= published", "top MFU",
                     "max MFU returned", "plan() s"], plan_rows))


if __name__ == "__main__":
    torch.set_num_threads(1)
    which = [a for a in sys.argv[1:] if "=" not in a] or ["paper", "speed", "memory", "dryrun", "ranking"]
    opts = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)  # ranking: rounds=7 steps=2 configs=tiny,demo
    rank_kw = {k: int(v) for k, v in opts.items() if k in ("rounds", "steps", "warmup")}
    if "configs" in opts:
        rank_kw["configs"] = tuple(opts["configs"].split(","))
    for w in which:
        if w == "ranking":
            bench_ranking(**rank_kw)
        elif w == "paper":
            bench_paper(with_plan=opts.get("plan", "0") == "1")
        else:
            {"speed": bench_speed, "memory": bench_memory, "dryrun": bench_dryrun}[w]()
