"""Pipeline parallelism (hyper_parallel.pipelining) on the example Llama, against one process.

Every job trains 3 AdamW steps with a global clip_grad_norm_ in float64 and compares the losses,
every parameter and every gradient (of the last step) with one process training the whole batch
(tolerance 1e-10). The union of the stages' state_dict keys is the whole model's.
"""
import contextlib
import math

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, Replicate, RowwiseParallel,
                            SequenceParallel, Shard, parallelize_module)
from hyper_parallel import pipelining as pp
from examples.llama.model import ModelArgs, Transformer, loss_fn
import examples.llama.parallelize  # noqa: F401  (SequenceParallel accepts the example RMSNorm)

ARGS = ModelArgs(dim=32, n_layers=4, n_heads=4, vocab_size=64, multiple_of=32, max_seq_len=16)
ARGS5 = ModelArgs(dim=32, n_layers=5, n_heads=4, vocab_size=64, multiple_of=32, max_seq_len=16)
BATCH, SEQ, STEPS, LR, CLIP = 8, 16, 3, 1e-2, 0.5
TOL = dict(rtol=1e-10, atol=1e-10)


def _model(args):
    return Transformer(args, init_seed=0).double()


def _batch(step, args):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=g)
    return x, torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=g)


def _reference(args):
    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, args)
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        losses.append(loss.item())
        if step < STEPS - 1:
            opt.step()
            opt.zero_grad()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return losses, {n: p.detach().clone() for n, p in model.state_dict().items()}, grads


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


def _clip_global(params, max_norm, pp_group):
    """clip_grad_norm_ over the whole model: the stages' squared norms summed over the pipeline ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        sq = sq + _full(g).pow(2).sum()
    dist.all_reduce(sq, group=pp_group)
    coef = min(max_norm / (math.sqrt(sq.item()) + 1e-6), 1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef)


def _tp_stage(stage, tp_mesh, first, last):
    """Megatron TP + SP inside one stage; the stage boundary is a DTensor Shard(1) on mesh['tp']."""
    seq = Shard(1)
    ends = {}
    if stage.tok_embeddings is not None:
        ends["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if stage.output is not None:
        ends["norm"] = SequenceParallel()
        ends["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    if ends:
        parallelize_module(stage, tp_mesh, ends)
    plan = {
        "attention": PrepareModuleInput(input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None),
                                        use_local_output=True),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                           use_local_output=True),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
    }
    keys = list(stage.layers.keys())
    for k in keys:
        parallelize_module(stage.layers[k], tp_mesh, plan)
    if keys and not first:  # the received DTensor activation -> this block's local sequence shard
        parallelize_module(stage.layers[keys[0]], tp_mesh, PrepareModuleInput(
            input_layouts=(seq, None, None), desired_input_layouts=(seq, None, None), use_local_output=True))
    if keys and not last:  # hand the next stage a DTensor, not a bare local shard
        parallelize_module(stage.layers[keys[-1]], tp_mesh, PrepareModuleOutput(
            output_layouts=seq, desired_output_layouts=seq, use_local_output=False))


def _pp_train(schedule, n_pp, n_mb, stages_per_rank=1, tp=1, dp=1, args=ARGS):
    torch.manual_seed(0)
    dims = [("pp", n_pp)] + [(n, s) for n, s in (("dp_shard", dp), ("tp", tp)) if s > 1]
    mesh = hp.init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    pp_mesh = mesh["pp"]
    model = _model(args)
    num_stages = n_pp * stages_per_rank
    parts = pp.split_into_stages(model, pp_mesh, num_stages=num_stages, schedule=schedule)
    groups = 0
    for s, m in parts:
        if tp > 1:
            _tp_stage(m, mesh["tp"], s == 0, s == num_stages - 1)
        if dp > 1:
            for blk in m.layers.values():
                hp.fully_shard(blk, mesh=mesh["dp_shard"])
                groups += 1
            hp.fully_shard(m, mesh=mesh["dp_shard"])
            groups += 1
    stages = [pp.PipelineStage(m, s, num_stages, torch.device("cpu"), group=pp_mesh.get_group()) for s, m in parts]
    cls = pp.get_schedule_class(schedule)
    sched = cls(stages[0] if stages_per_rank == 1 else stages, n_microbatches=n_mb, loss_fn=loss_fn)
    params = [p for _, m in parts for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    has_first = any(s == 0 for s, _ in parts)
    has_last = any(s == num_stages - 1 for s, _ in parts)
    dp_rank = mesh["dp_shard"].get_local_rank() if dp > 1 else 0
    losses, rs_counts, stats = [], [], []
    for step in range(STEPS):
        x, y = _batch(step, args)
        lo, hi = dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp
        x, y = x[lo:hi], y[lo:hi]
        mb_losses = []
        # not on the first step: torch's metadata inference runs autograd.grad, which CommDebugMode's
        # module tracker (torch's multi-grad hooks) does not support
        # (and only with FSDP: zero-bubble schedules' split backward runs autograd.grad too)
        comm = hp.CommDebugMode() if step > 0 and dp > 1 else contextlib.nullcontext()
        with comm:
            sched.step(*((x,) if has_first else ()), target=y if has_last else None,
                       losses=mb_losses if has_last else None)
        stats.append({st.stage_index: st.step_stats for st in stages})
        if step > 0 and dp > 1:
            # the data-parallel group's reduce_scatters (TP+SP adds its own on the tp group)
            dp_ranks = set(mesh["dp_shard"].rank_list)
            rs_counts.append(sum(1 for kind, _, ranks in comm.events
                                 if "reduce_scatter" in str(kind) and set(ranks) == dp_ranks))
        if has_last:
            losses.append(sum(_full(l).item() for l in mb_losses) / n_mb)
        _clip_global(params, CLIP, pp_mesh.get_group())
        if step == STEPS - 1:
            grads = {n: _full(p.grad).clone() for _, m in parts for n, p in m.named_parameters()}
        opt.step()
        opt.zero_grad()
    state = {}
    for _, m in parts:
        for n, v in m.state_dict().items():
            state[n] = _full(v).detach().clone()
    return dict(losses=losses, state=state, grads=grads, rs=rs_counts, groups=groups, stats=stats,
                stages=[s for s, _ in parts],
                boundary={st.stage_index: (st._hp_in_layouts, st._hp_out_layouts) for st in stages})


def _check(results, args=ARGS, dp=1):
    ref_losses, ref_state, ref_grads = _reference(args)
    state, grads, losses = {}, {}, []
    for r in results:
        state.update(r["state"])
        grads.update(r["grads"])
        if r["losses"]:
            losses.append(r["losses"])
    assert set(state) == set(ref_state), sorted(set(state) ^ set(ref_state))
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    got = torch.tensor(losses, dtype=torch.float64).mean(0)  # dp ranks: mean of equal-size shards' means
    torch.testing.assert_close(got, torch.tensor(ref_losses, dtype=torch.float64), **TOL)
    for n in ref_state:
        torch.testing.assert_close(state[n], ref_state[n], **TOL, msg=f"parameter {n}")
        torch.testing.assert_close(grads[n], ref_grads[n], **TOL, msg=f"gradient {n}")


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_single_stage_schedules_match_one_process(dist_runner, schedule):
    res = dist_runner.run(2, _pp_train, schedule, 2, 4)
    assert [r["stages"] for r in res] == [[0], [1]]
    _check(res)


def test_interleaved_1f1b_two_stages_per_rank(dist_runner):
    res = dist_runner.run(2, _pp_train, "Interleaved1F1B", 2, 4, 2)
    assert [r["stages"] for r in res] == [[0, 2], [1, 3]]  # looped stage-to-rank map
    _check(res)


def test_uneven_layers(dist_runner):
    res = dist_runner.run(2, _pp_train, "1F1B", 2, 4, 1, 1, 1, ARGS5)
    _check(res, ARGS5)


def test_pp_with_tp_dtensor_boundary(dist_runner):
    res = dist_runner.run(4, _pp_train, "1F1B", 2, 4, 1, 2)
    _check(res)
    # the activation crossed as a DTensor: local [2, 8, 32] shards, rebuilt as Shard(1) of [2, 16, 32]
    # (microbatch 8 / 4) on the receiving ranks' own tp mesh
    for r in res:
        ins, outs = r["boundary"][r["stages"][0]]
        lay = ins[0] if r["stages"][0] == 1 else outs[0]
        assert lay.placements == (Shard(1),) and lay.shape == (2, SEQ, 32), lay
        assert lay.mesh_dim_names == ("tp",) and lay.mesh_shape == (2,), lay


def test_pp_with_fully_shard_reduces_once_per_step(dist_runner):
    res = dist_runner.run(4, _pp_train, "1F1B", 2, 4, 1, 1, 2)
    _check(res)
    for r in res:
        # every step: one reduce_scatter per fully_shard group, not one per group and microbatch
        assert r["rs"] == [r["groups"]] * (STEPS - 1), (r["rs"], r["groups"])


def _bad_inputs():
    """Each bad argument raises on the rank that holds it, before any message is sent."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    rank = mesh.get_local_rank()
    (s, m), = pp.split_into_stages(_model(ARGS), mesh, schedule="1F1B")
    stage = pp.PipelineStage(m, s, 2, torch.device("cpu"), group=mesh)
    errors = []

    def expect(fn, *needles):
        with pytest.raises(ValueError) as e:
            fn()
        for n in needles:
            assert n in str(e.value), (n, str(e.value))
        errors.append(str(e.value))

    expect(lambda: pp.Schedule1F1B(stage, n_microbatches=1, loss_fn=loss_fn), "n_microbatches=1", "(2)")
    expect(lambda: pp.ScheduleGPipe(stage, n_microbatches=0, loss_fn=loss_fn), "n_microbatches", "0")
    expect(lambda: pp.ScheduleZBVZeroBubble([stage], n_microbatches=4, loss_fn=loss_fn), "stages", "exactly 2")
    x, y = _batch(0, ARGS)
    sched = pp.ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    if rank == 0:
        expect(lambda: sched.step(x[:6]), "args[0]", "size 6", "n_microbatches=4")
    else:
        expect(lambda: sched.step(target=y[:6], losses=[]), "target", "size 6", "n_microbatches=4")
    no_loss = pp.ScheduleGPipe(stage, n_microbatches=4)
    expect(lambda: no_loss.step(*((x,) if rank == 0 else ()), target=y), "loss_fn=None", "target=")
    expect(lambda: pp.split_into_stages(_model(ARGS), mesh, num_stages=4, schedule="1F1B"), "num_stages=4")
    expect(lambda: pp.split_into_stages(_model(ARGS), mesh, num_stages=2, schedule="ZBVZeroBubble"),
           "num_stages=2", "2 * 2")
    expect(lambda: pp.split_into_stages(_model(ARGS), mesh, num_stages=7, layers_per_stage=2), "num_stages=7",
           "layers_per_stage=2")
    tied = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, multiple_of=32, max_seq_len=16, tie_embeddings=True)
    expect(lambda: pp.split_into_stages(_model(tied), mesh, schedule="GPipe"), "tok_embeddings.weight",
           "output.weight")
    expect(lambda: pp.PipelineStage(m, 2, 2, torch.device("cpu")), "stage_index=2", "num_stages=2")
    # the processes are still in step: a pipeline runs after the errors
    dist.barrier()
    return len(errors)


def test_bad_inputs_name_argument_and_value(dist_runner):
    assert dist_runner.run(2, _bad_inputs) == [10, 10]


def test_reexports_and_split_plan():
    import torch.distributed.pipelining as tpp
    assert pp.microbatch is tpp.microbatch
    for name in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                 "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        ours = getattr(pp, name)
        assert issubclass(ours, getattr(tpp, name)) and pp.get_schedule_class(name[len("Schedule"):]) is ours
    assert issubclass(pp.PipelineStage, tpp.PipelineStage)
    # 5 blocks + embedding + head over 2 stages: 4 + 3 layers; over 4 stages with 2 per stage
    assert pp.plan_stages([str(i) for i in range(5)], 2) == [["0", "1", "2"], ["3", "4"]]
    assert pp.plan_stages([str(i) for i in range(5)], layers_per_stage=2) == [["0"], ["1", "2"], ["3", "4"], []]
    assert pp.stage_ids_on_rank(1, 2, 4, "looped") == [1, 3]
    assert pp.stage_ids_on_rank(0, 2, 4, "v") == [0, 3] and pp.stage_ids_on_rank(1, 2, 4, "v") == [1, 2]
