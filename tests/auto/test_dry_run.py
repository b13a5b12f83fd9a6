"""dry_run on torch's fake process group (one process) against the same step on real gloo ranks, and
Cluster.measure() on real gloo ranks."""
import pytest
import torch
import torch.distributed as dist

from examples.llama.configs import get_config
from examples.llama.model import Transformer, build_model
from hyper_parallel.auto import Cluster, dry_run, evaluate_plan

CASES = {  # name: (config, degrees, sequence parallel, other choices)
    "fsdp2-tp2-sp": ("tiny", {"fsdp": 2, "tp": 2}, True, {}),
    "dp2-fsdp2": ("tiny", {"dp": 2, "fsdp": 2}, False, {}),
    "moe-fsdp4-ep2": ("moe-tiny", {"fsdp": 4, "ep": 2}, False, {}),
    "fsdp2-tp2-sp-selective-ac": ("tiny", {"fsdp": 2, "tp": 2}, True, {"activation_checkpointing": "selective"}),
    # context parallelism: the ring's receives leave zeros under the fake group, sizes are the same
    "cp2-fsdp2-ring": ("tiny", {"fsdp": 2, "cp": 2}, False, {"cp_method": "ring"}),
    "cp2-tp2-sp-ulysses": ("tiny", {"cp": 2, "tp": 2}, True, {"cp_method": "ulysses"}),
    # pipelines: every stage role (first, middle, last), static stage shapes, zeroed receive buffers
    "pp2-fsdp2-1f1b": ("tiny", {"pp": 2, "fsdp": 2}, False, {"pp_schedule": "1f1b", "microbatches": 2}),
    "pp2-tp2-sp-gpipe": ("tiny", {"pp": 2, "tp": 2}, True, {"pp_schedule": "gpipe", "microbatches": 4}),
    "pp2-cp2-1f1b": ("tiny", {"pp": 2, "cp": 2}, False, {"pp_schedule": "1f1b", "microbatches": 2}),
    "pp4-gpipe": ("demo", {"pp": 4}, False, {"pp_schedule": "gpipe", "microbatches": 4}),
    "pp2-fsdp2-interleaved-ac": ("demo", {"pp": 2, "fsdp": 2}, False,
                                 {"pp_schedule": "interleaved1f1b", "microbatches": 2,
                                  "activation_checkpointing": "full"}),
}


def _plan(case, world=4):
    name, deg, sp, kw = CASES[case]
    cfg = get_config(name)
    with torch.device("meta"):
        m = Transformer(cfg.model, init_seed=None)
    return cfg, evaluate_plan(m, Cluster(world, world, "1GiB"), degrees=deg, global_batch=cfg.global_batch,
                              seq_len=cfg.seq_len, sequence_parallel=sp, **kw)


def _real(case):
    """The real step, measured twice (a fresh model each time); the lower peak is kept. gloo's worker threads
    drop their last references to finished collectives' buffers when they get to it, so on a loaded
    machine a buffer can outlive its ``wait()`` and add to one run's peak (it can only add); the dry run
    models the backend's own lifetimes. Collectives and state bytes are the same in both runs."""
    from hyper_parallel.auto.dry_run import measure_step
    cfg, plan = _plan(case)
    reps = [measure_step(plan, lambda: build_model(cfg.model, cfg.seed)) for _ in range(2)]
    assert reps[0].collectives == reps[1].collectives and reps[0].state_bytes == reps[1].state_bytes
    return min(reps, key=lambda rep: rep.peak_memory)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dry_run_matches_real_ranks(dist_runner, case):
    from hyper_parallel.auto.dry_run import _roles
    cfg, plan = _plan(case)
    fake = dry_run(plan, lambda: build_model(cfg.model, cfg.seed), world_size=4)
    roles = _roles(plan, 4)
    assert set(fake.ranks) == set(roles)
    if plan.degrees["pp"] > 1:  # the first rank of every stage: first, middle and last roles
        assert set(roles) == {s * 4 // plan.degrees["pp"] for s in range(plan.degrees["pp"])}
    real = dist_runner.run(4, _real, case)
    for r, rep in fake.ranks.items():
        got = real[r]
        assert rep.collectives, rep  # a real step ran: it issued collectives (p2p or others)
        if case.startswith("moe"):  # the expert dispatch sizes depend on the other ranks' routing, which the fake
            # group cannot know (its all_to_all moves no data): same collectives, EP all_to_all bytes aside
            strip = lambda ev: [(k, None if k == "all_to_all" else b, n) for k, b, n in ev]
            assert strip(rep.collectives) == strip(got.collectives)
        else:
            assert rep.collectives == got.collectives  # same kinds, bytes and group sizes, in issue order
        assert rep.state_bytes == got.state_bytes
        assert abs(rep.peak_memory - got.peak_memory) <= 0.05 * got.peak_memory, (rep.peak_memory, got.peak_memory)
    assert max(r.state_bytes for r in fake.ranks.values()) == plan.state_max


def test_dry_run_bad_arguments():
    cfg, plan = _plan("fsdp2-tp2-sp")
    with pytest.raises(ValueError, match="world_size=8 differs from the plan's world size 4"):
        dry_run(plan, lambda: build_model(cfg.model, cfg.seed), world_size=8)
    with pytest.raises(ValueError, match=r"rank=9 is not in \[0, 4\)"):
        dry_run(plan, lambda: build_model(cfg.model, cfg.seed), world_size=4, rank=9)


def _measure():
    c = Cluster(dist.get_world_size(), dist.get_world_size(), "1GiB").measure(sizes=(2**12, 2**18), repeats=2)
    return c.flops, c.intra_node_bw, c.latency, sorted(c.comm)


def test_cluster_measure_on_gloo(dist_runner):
    out = dist_runner.run(2, _measure)
    assert all(o == out[0] for o in out)  # every rank agrees (the slowest rank's times)
    flops, bw, lat, kinds = out[0]
    assert flops > 1e6 and bw > 1e3 and lat >= 0
    assert kinds == ["all_gather", "all_reduce", "all_to_all", "p2p", "reduce_scatter"]


def test_dry_run_several_plans_and_worlds_in_one_process():
    """The fake worlds do not leak into each other (cached layouts of equal meshes are dropped between them):
    the same plan dry-run again, after another plan and another world size, reports the same numbers."""
    cfg, plan = _plan("fsdp2-tp2-sp")
    build = lambda: build_model(cfg.model, cfg.seed)
    first = dry_run(plan, build, world_size=4, rank=0).ranks[0]
    _, full = _plan("pp2-fsdp2-1f1b")
    dry_run(full, build, world_size=4, rank=0)
    with torch.device("meta"):
        m = Transformer(cfg.model, init_seed=None)
    p8 = evaluate_plan(m, Cluster(8, 8, "1GiB"), degrees={"fsdp": 4, "tp": 2}, global_batch=cfg.global_batch,
                       seq_len=cfg.seq_len, sequence_parallel=True)
    eight = dry_run(p8, build, world_size=8, rank=0).ranks[0]
    again = dry_run(plan, build, world_size=4, rank=0).ranks[0]
    assert again.collectives == first.collectives and again.state_bytes == first.state_bytes
    assert abs(again.peak_memory - first.peak_memory) <= 64, (again.peak_memory, first.peak_memory)
    assert eight.state_bytes < first.state_bytes  # fsdp 4: smaller shards than at world 4


def _real8():
    from hyper_parallel.auto.dry_run import measure_step
    cfg, plan = _plan8()
    return measure_step(plan, lambda: build_model(cfg.model, cfg.seed))


def _plan8():
    cfg = get_config("demo")
    with torch.device("meta"):
        m = Transformer(cfg.model, init_seed=None)
    return cfg, evaluate_plan(m, Cluster(8, 8, "1GiB"), degrees={"pp": 2, "fsdp": 2, "tp": 2}, global_batch=cfg.global_batch,
                              seq_len=cfg.seq_len, sequence_parallel=True, pp_schedule="1f1b", microbatches=4)


def test_dry_run_pipeline_world8_matches_real_ranks(dist_runner):
    """pp2 x fsdp2 x tp2+sp at world 8: both stage roles against the real 8-process step."""
    cfg, plan = _plan8()
    fake = dry_run(plan, lambda: build_model(cfg.model, cfg.seed), world_size=8)
    assert set(fake.ranks) == {0, 4}
    real = dist_runner.run(8, _real8, timeout=600)
    for r, rep in fake.ranks.items():
        assert rep.collectives == real[r].collectives and rep.state_bytes == real[r].state_bytes
        assert abs(rep.peak_memory - real[r].peak_memory) <= 0.05 * real[r].peak_memory, \
            (r, rep.peak_memory, real[r].peak_memory)


def test_dry_run_leaves_process_group_methods_as_they_were():
    """The dry run wraps ``ProcessGroup``'s collectives while it runs; afterwards the class holds the very
    same attributes again (putting back ``getattr``'s bare builtin broke every later collective of the
    process: "incompatible function arguments", self no longer bound)."""
    from torch._C._distributed_c10d import ProcessGroup
    from hyper_parallel.auto.dry_run import _PG_CALLS, _works_hold_tensors
    before = {n: ProcessGroup.__dict__.get(n) for n in _PG_CALLS}
    with _works_hold_tensors():
        assert any(ProcessGroup.__dict__.get(n) is not before[n] for n in _PG_CALLS)
    after = {n: ProcessGroup.__dict__.get(n) for n in _PG_CALLS}
    assert all(after[n] is before[n] for n in _PG_CALLS), [n for n in _PG_CALLS if after[n] is not before[n]]
