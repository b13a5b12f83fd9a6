"""Heterogeneous pipeline stages: stages on meshes of different shapes and sizes.

Stage 0 of the example Llama runs on ranks [0, 1, 2, 3] with TP 4 (+SP) and stage 1 on ranks [4, 5]
with TP 2 (the issue's layout), or 2 + 1 ranks; the boundary activation is a ``Shard(1)`` DTensor on each side's own mesh, moved
(and its gradient moved back) as the cross-mesh plan's point-to-point messages, driven by torch's
1F1B runtime. 3 AdamW steps with a global clip_grad_norm_, float64: losses, every parameter and
every gradient equal one process's (1e-10); the boundary's messages per step are the plan's.
"""
import math

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import DeviceMesh, Shard
from hyper_parallel import pipelining as pp
from examples.llama.model import loss_fn
from tests.pipelining.test_pipelining import (ARGS, BATCH, CLIP, LR, SEQ, STEPS, TOL, _batch, _full, _model, _reference,
                                   _tp_stage)

N_MB = 4


def _example(mesh, tp):
    """A boundary example: one microbatch's hidden states, Shard(1) (sequence) on ``mesh``."""
    mb = BATCH // N_MB
    local = torch.zeros(mb, SEQ // tp, ARGS.dim, dtype=torch.float64)
    shape = (mb, SEQ, ARGS.dim)
    return hp.DTensor.from_local(local, mesh, [Shard(1)], shape=shape, stride=(SEQ * ARGS.dim, ARGS.dim, 1))


def _hetero(layout):
    torch.manual_seed(0)
    rank = dist.get_rank()
    meshes = [DeviceMesh("cpu", r) for r in layout]  # every rank builds every stage's mesh, in order
    s = next(i for i, r in enumerate(layout) if rank in r)
    mesh = meshes[s]
    tp = mesh.size()
    m = pp.stage_module(_model(ARGS), s, 2)
    _tp_stage(m, mesh, s == 0, s == 1)
    stage = pp.HeteroPipelineStage(m, s, 2, torch.device("cpu"),
                                   input_args=_example(mesh, tp) if s == 1 else None,
                                   output_args=_example(mesh, tp) if s == 0 else None)
    sched = pp.Schedule1F1B(stage, n_microbatches=N_MB, loss_fn=loss_fn)
    params = list(m.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    losses, sent = [], []
    for step in range(STEPS):
        x, y = _batch(step, ARGS)
        mb_losses = []
        sched.step(*((x,) if s == 0 else ()), target=y if s == 1 else None, losses=mb_losses if s == 1 else None)
        sent.append(stage.step_stats["sent_messages"])
        if s == 1:
            losses.append(sum(_full(l).item() for l in mb_losses) / N_MB)
        # global clip: one squared norm per stage
        sq = sum(_full(p.grad).pow(2).sum().item() for p in params)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (s, sq))
        total = sum(dict(per_rank).values())
        coef = min(CLIP / (math.sqrt(total) + 1e-6), 1.0)
        with torch.no_grad():
            for p in params:
                p.grad.mul_(coef)
        if step == STEPS - 1:
            grads = {n: _full(p.grad).clone() for n, p in m.named_parameters()}
        opt.step()
        opt.zero_grad()
    state = {n: _full(v).detach().clone() for n, v in m.state_dict().items()}
    return dict(stage=s, losses=losses, state=state, grads=grads, sent=sent)


@pytest.mark.parametrize("layout", [[[0, 1, 2, 3], [4, 5]]], ids=["tp4+tp2"])  # also passes with [[0, 1], [2]]
def test_hetero_stages_train_like_one_process(dist_runner, layout):
    world = sum(len(r) for r in layout)
    res = dist_runner.run(world, _hetero, layout)
    ref_losses, ref_state, ref_grads = _reference(ARGS)
    state, grads = {}, {}
    for r in res:
        state.update(r["state"])
        grads.update(r["grads"])
    assert set(state) == set(ref_state)
    losses = [r["losses"] for r in res if r["losses"]]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref_losses), **TOL)
    for n in ref_state:
        torch.testing.assert_close(state[n], ref_state[n], **TOL, msg=f"parameter {n}")
        torch.testing.assert_close(grads[n], ref_grads[n], **TOL, msg=f"gradient {n}")
    # each stage-0 rank's sequence shard lies inside one stage-1 rank's: one message per microbatch;
    # each stage-1 rank sends the gradient pieces back to the stage-0 ranks it received from
    for r in res:
        k = len(layout[0]) // len(layout[1])
        assert r["sent"] == [N_MB * (k if r["stage"] == 1 else 1)] * STEPS, r["sent"]


def _hetero_mismatch():
    """Stage 1 declares a sequence of 8 where stage 0 sends 16: every rank raises, naming both stages."""
    layout = [[0, 1, 2, 3], [4, 5]]
    rank = dist.get_rank()
    meshes = [DeviceMesh("cpu", r) for r in layout]
    s = 0 if rank < 4 else 1
    mesh = meshes[s]
    m = pp.stage_module(_model(ARGS), s, 2)
    ex = _example(mesh, mesh.size())
    if s == 1:
        mb = BATCH // N_MB
        ex = hp.DTensor.from_local(torch.zeros(mb, 4, ARGS.dim, dtype=torch.float64), mesh, [Shard(1)],
                                   shape=(mb, 8, ARGS.dim), stride=(8 * ARGS.dim, ARGS.dim, 1))
    stage = pp.HeteroPipelineStage(m, s, 2, torch.device("cpu"), input_args=ex if s == 1 else None,
                                   output_args=ex if s == 0 else None)
    sched = pp.ScheduleGPipe(stage, n_microbatches=N_MB, loss_fn=loss_fn)
    x, y = _batch(0, ARGS)
    with pytest.raises(ValueError) as e:
        sched.step(*((x,) if s == 0 else ()), target=y if s == 1 else None, losses=[] if s == 1 else None)
    dist.barrier()
    return str(e.value)


def test_hetero_boundary_mismatch_on_every_rank(dist_runner):
    msgs = dist_runner.run(6, _hetero_mismatch)
    for m in msgs:
        assert "stages 0 and 1" in m and "DTensor[2, 16, 32]" in m and "DTensor[2, 8, 32]" in m, m
