"""More schedules and layouts of hyper_parallel.pipelining, against one process.

Each job is ``tests.pipelining.test_pipelining._pp_train``: the example Llama split into stages, 3 AdamW
steps with a global clip_grad_norm_ in float64; losses, every parameter and every gradient equal
one process's to 1e-10. On top:

* boundary point-to-point messages per step, counted where our stage hands torch its send ops
  (``PipelineStage.step_stats``): 2 x M x (boundaries between stages on different ranks), and
  their bytes are the activations' bytes;
* live microbatch activations (the stage's forward cache of microbatches awaiting backward):
  with 1F1B at most ``num_stages`` on stage 0, with GPipe all M.
"""
import pytest

from examples.llama.model import ModelArgs
from tests.pipelining.test_pipelining import ARGS, BATCH, SEQ, _check, _pp_train

# 6 blocks + embedding + head = 8 layers: one per stage of an 8-stage (4 ranks x 2) pipeline
ARGS6 = ModelArgs(dim=32, n_layers=6, n_heads=4, vocab_size=64, multiple_of=32, max_seq_len=16)


def _sent(res, step):
    """Messages sent by all ranks in one step (the same on every step: no metadata after the first)."""
    return sum(s["sent_messages"] for r in res for s in r["stats"][step].values())


def _cross_rank_boundaries(res):
    where = {s: i for i, r in enumerate(res) for s in r["stages"]}
    n = len(where)
    return sum(1 for s in range(n - 1) if where[s] != where[s + 1])


def _check_p2p(res, n_mb):
    b = _cross_rank_boundaries(res)
    for step in range(len(res[0]["stats"])):
        assert _sent(res, step) == 2 * n_mb * b, (step, _sent(res, step), n_mb, b)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_schedules_two_ranks(dist_runner, schedule):
    res = dist_runner.run(2, _pp_train, schedule, 2, 4, 2)
    assert [r["stages"] for r in res] == [[0, 3], [1, 2]]  # V-shaped map; stage 1 -> 2 stays on rank 1
    _check(res)
    assert _cross_rank_boundaries(res) == 2
    _check_p2p(res, 4)


@pytest.mark.parametrize("schedule", ["LoopedBFS", "InterleavedZeroBubble"])
def test_other_looped_schedules_two_ranks(dist_runner, schedule):
    res = dist_runner.run(2, _pp_train, schedule, 2, 4, 2)
    assert [r["stages"] for r in res] == [[0, 2], [1, 3]]  # looped map
    _check(res)
    _check_p2p(res, 4)


@pytest.mark.parametrize("schedule,per_rank,args", [("GPipe", 1, ARGS), ("1F1B", 1, ARGS),
                                                    ("Interleaved1F1B", 2, ARGS6), ("ZBVZeroBubble", 2, ARGS6),
                                                    ("DualPipeV", 2, ARGS6)])
def test_four_rank_pipelines(dist_runner, schedule, per_rank, args):
    n_mb = 8 if schedule == "DualPipeV" else 4
    res = dist_runner.run(4, _pp_train, schedule, 4, n_mb, per_rank, 1, 1, args)
    _check(res, args)
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        assert [r["stages"] for r in res] == [[i, 7 - i] for i in range(4)]  # V map
    else:
        assert [r["stages"] for r in res] == [[i, i + 4] if per_rank == 2 else [i] for i in range(4)]
    _check_p2p(res, n_mb)


def test_pp_dp_tp_eight_ranks(dist_runner):
    """pp 2 x dp_shard 2 x tp 2: TP+SP and fully_shard inside each stage, 1F1B."""
    res = dist_runner.run(8, _pp_train, "1F1B", 2, 2, 1, 2, 2, timeout=300)
    _check(res, dp=2)
    for r in res:
        assert r["rs"] == [r["groups"]] * (len(r["rs"])), (r["rs"], r["groups"])  # once per group and step
    # every (dp, tp) pair of ranks has its own pipeline: 4 pipelines x 2 x M=2 x 1 boundary
    assert _sent(res, 0) == 4 * 2 * 2 * 1


def test_p2p_bytes_are_activation_bytes(dist_runner):
    res = dist_runner.run(2, _pp_train, "1F1B", 2, 4)
    _check_p2p(res, 4)
    act = (BATCH // 4) * SEQ * ARGS.dim * 8  # one microbatch's hidden states, float64
    for step in range(3):
        sent = {s: v["sent_bytes"] for r in res for s, v in r["stats"][step].items()}
        assert sent == {0: 4 * act, 1: 4 * act}, sent  # activations forward, their gradients back


def test_live_activations_1f1b_bounded_gpipe_grows(dist_runner):
    n_mb = 8
    peaks = {}
    for schedule in ("1F1B", "GPipe"):
        res = dist_runner.run(2, _pp_train, schedule, 2, n_mb)
        _check(res)
        peaks[schedule] = [r["stats"][-1][r["stages"][0]]["peak_live_microbatches"] for r in res]
    num_stages = 2
    assert peaks["1F1B"][0] <= num_stages and peaks["GPipe"][0] == n_mb, peaks
    assert peaks["1F1B"] == [2, 1], peaks  # stage 0 holds num_stages, the last stage one at a time


def _boundary_mismatch(static):
    """Stage 0 outputs [*, 6], stage 1 takes [*, 5]: both ranks raise at the first step, naming both."""
    import torch
    import torch.distributed as dist
    from hyper_parallel import pipelining as pp
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    rank = mesh.get_local_rank()
    torch.manual_seed(0)
    mod = torch.nn.Linear(8, 6) if rank == 0 else torch.nn.Linear(5, 3)
    mod = mod.double()
    mb = 2
    kw = {}
    if static:
        ins = torch.zeros(mb, 8 if rank == 0 else 5, dtype=torch.float64)
        outs = torch.zeros(mb, 6 if rank == 0 else 3, dtype=torch.float64)
        kw = dict(input_args=(ins,), output_args=(outs,))
    stage = pp.PipelineStage(mod, rank, 2, torch.device("cpu"), group=mesh.get_group(), **kw)
    sched = pp.ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, tgt: out.sum())
    x = torch.randn(4, 8, dtype=torch.float64)
    try:
        sched.step(*((x,) if rank == 0 else ()), target=torch.zeros(4) if rank == 1 else None,
                   losses=[] if rank == 1 else None)
    except ValueError as e:
        msg = str(e)
    else:
        msg = None
    dist.barrier()
    return msg


@pytest.mark.parametrize("static", [False, True])
def test_boundary_shape_mismatch_named_on_both_ranks(dist_runner, static):
    msgs = dist_runner.run(2, _boundary_mismatch, static)
    for m in msgs:
        assert m is not None and "stages 0 and 1" in m, msgs
        assert "[2, 6] float64" in m, msgs  # what stage 0 sends
    if static:
        assert all("[2, 5] float64" in m for m in msgs), msgs  # what stage 1 declared
    else:
        assert "mat1 and mat2" in msgs[1] or "shape" in msgs[1], msgs  # the module's own error, kept


def _timed_step():
    """step_stats["compute_s"] with time_compute=True: positive and below the step's wall time."""
    import time
    import torch
    import hyper_parallel as hp
    from hyper_parallel import pipelining as pp
    from examples.llama.model import loss_fn
    from tests.pipelining.test_pipelining import _batch, _model
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    (s, m), = pp.split_into_stages(_model(ARGS), mesh, schedule="GPipe")
    stage = pp.PipelineStage(m, s, 2, torch.device("cpu"), group=mesh)
    sched = pp.ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    out = []
    for timed in (False, True):
        stage.time_compute = timed
        x, y = _batch(0, ARGS)
        t0 = time.perf_counter()
        sched.step(*((x,) if s == 0 else ()), target=y if s == 1 else None, losses=[] if s == 1 else None)
        out.append((stage.step_stats["compute_s"], time.perf_counter() - t0))
    return out


def test_compute_time_for_bubble_measurement(dist_runner):
    for (off, _), (on, wall) in dist_runner.run(2, _timed_step):
        assert off == 0.0 and 0.0 < on < wall, (off, on, wall)


def _stage_map_errors():
    """Stage counts and indices that do not match the pipeline group, and DualPipeV's microbatch floor."""
    import torch
    import hyper_parallel as hp
    from hyper_parallel import pipelining as pp
    from examples.llama.model import loss_fn
    from tests.pipelining.test_pipelining import _model
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    rank = mesh.get_local_rank()
    parts = pp.split_into_stages(_model(ARGS6), mesh, schedule="DualPipeV")
    v = [pp.PipelineStage(m, s, 4, torch.device("cpu"), group=mesh) for s, m in parts]
    errs = []
    for fn, needles in (
            (lambda: pp.ScheduleDualPipeV(v, n_microbatches=2, loss_fn=loss_fn), ("n_microbatches=2", "(4)")),
            # a one-stage-per-rank schedule on stages built for 4 stages over 2 ranks
            (lambda: pp.Schedule1F1B(v[0], n_microbatches=4, loss_fn=loss_fn), ("num_stages=4", "2 ranks")),
            # the looped map puts stages r, r + 2 on rank r, not the V's r, 3 - r
            (lambda: pp.ScheduleInterleaved1F1B(v, n_microbatches=4, loss_fn=loss_fn),
             (f"stage indices {sorted(s for s, _ in parts)}", f"[{rank}, {rank + 2}]"))):
        with pytest.raises(ValueError) as e:
            fn()
        for n in needles:
            assert n in str(e.value), (n, str(e.value))
        errs.append(str(e.value))
    return len(errs)


def test_stage_map_errors(dist_runner):
    assert dist_runner.run(2, _stage_map_errors) == [3, 3]


def _zb_fsdp_body():
    import torch
    import hyper_parallel as hp
    from hyper_parallel import pipelining as pp
    import torch.distributed as dist
    from hyper_parallel.pipelining import schedules as S
    rank = dist.get_rank()
    own = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]   # a 1-rank pipeline per rank
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    mods = [torch.nn.Linear(4, 4).double() for _ in range(2)]
    for m in mods:
        hp.fully_shard(m, mesh=mesh)
    stages = [pp.PipelineStage(m, i, 2, torch.device("cpu"), group=own) for i, m in enumerate(mods)]
    out = {}
    for cls in (S.ScheduleZBVZeroBubble, S.ScheduleDualPipeV):
        try:
            cls(stages, 2, loss_fn=lambda y, t: y.sum())
        except NotImplementedError as exc:
            out[cls.__name__] = str(exc)
    return out


def test_zero_bubble_schedules_refuse_fully_shard_stages(dist_runner):
    """The split weight pass bypasses fully_shard's reduce-scatter: refused, never a silent wrong gradient."""
    for out in dist_runner.run(2, _zb_fsdp_body):
        assert set(out) == {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}, out
        for name, msg in out.items():
            assert "contains fully_shard (FSDPModule) modules" in msg and "Schedule1F1B" in msg, msg


def _no_grad_path_body():
    import torch
    import hyper_parallel as hp
    from hyper_parallel import pipelining as pp
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    lin = torch.nn.Linear(4, 4).double()
    stage = pp.PipelineStage(lin, 0, 2, torch.device("cpu"))
    out = hp.distribute_tensor(torch.ones(2, 4, dtype=torch.float64), mesh, [hp.Replicate()])
    try:
        stage._hp_unwrap_outputs(out)  # a DTensor output with no gradient path, trainable parameters
    except RuntimeError as exc:
        msg = str(exc)
    else:
        msg = None
    ok = stage._hp_unwrap_outputs(out.detach().requires_grad_())  # with a gradient path: passes through
    return msg, tuple(ok.shape)


def test_stage_output_without_gradient_path_raises(dist_runner):
    """A non-last stage whose outputs carry no gradient path would silently get no gradients (torch's
    backward skips such outputs): the stage says so, naming the usual cause."""
    for msg, shape in dist_runner.run(2, _no_grad_path_body):
        assert msg is not None and "PipelineStage 0: none of the stage's outputs requires grad" in msg, msg
        assert "block.forward = torch.compile(block.forward)" in msg and shape == (2, 4)
