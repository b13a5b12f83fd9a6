"""HyperParallel's pipeline API (hyper_parallel.core.pipeline_parallel) against one process.

The stages are the example Llama split by ``split_into_stages`` with TP inside them (their
parameters and the boundary activation are DTensors on a HyperParallel-semantics mesh from
``hp.init_device_mesh``). HyperParallel's semantics: the last stage returns the loss (here
``loss / micro_batch_num``, so the sum over microbatches is the whole batch's mean) and ``run``
returns the microbatch losses stacked. 3 AdamW steps with a global clip_grad_norm_, float64;
losses, every parameter and every gradient equal one process's to 1e-10.
"""
import contextlib

import pytest
import torch
import torch.nn as nn

import hyper_parallel as hp
from hyper_parallel import pipelining as pp
from hyper_parallel.core import pipeline_parallel as hpp
from examples.llama.model import loss_fn
from tests.pipelining.test_pipelining import ARGS, CLIP, LR, STEPS, TOL, _batch, _clip_global, _full, _model, _reference, _tp_stage


class _HPStage(nn.Module):
    """A stage as HyperParallel wants it: the last one returns the loss (labels arrive as a kwarg)."""

    def __init__(self, m, last, n_mb):
        super().__init__()
        self.m, self.last, self.n_mb = m, last, n_mb

    def forward(self, h, labels=None):
        out = self.m(h)
        return loss_fn(_full(out), labels) / self.n_mb if self.last else out


def _hp_train(per_rank, tp, n_mb, use_mesh, dp=1):
    torch.manual_seed(0)
    dims = (2,) + ((dp,) if dp > 1 else ()) + ((tp,) if tp > 1 else ())
    names = ("pp",) + (("dp_shard",) if dp > 1 else ()) + (("tp",) if tp > 1 else ())
    mesh = hp.init_device_mesh("cpu", dims, mesh_dim_names=names)
    num_stages = 2 * per_rank
    schedule = "1F1B" if per_rank == 1 else "Interleaved1F1B"
    parts = pp.split_into_stages(_model(ARGS), mesh["pp"], num_stages=num_stages, schedule=schedule)
    stages = []
    for s, m in parts:
        if tp > 1:
            _tp_stage(m, mesh["tp"], s == 0, s == num_stages - 1)
        wrapped = _HPStage(m, s == num_stages - 1, n_mb)
        if dp > 1:  # torchtitan's order: blocks, then the stage root (the module the stage runs)
            for blk in m.layers.values():
                hp.fully_shard(blk, mesh=mesh["dp_shard"])
            hp.fully_shard(wrapped, mesh=mesh["dp_shard"])
        # with neither mesh nor group: HyperParallel's rank arithmetic (pipeline outermost)
        stages.append(hpp.PipelineStage(wrapped, s, num_stages, mesh=mesh["pp"] if use_mesh else None))
    if per_rank == 1:
        sched = hpp.Schedule1F1B(stages[0], n_mb, args_batch_dim=hpp.BatchDimSpec(0), kwargs_batch_dim={"labels": 0})
    else:
        sched = hpp.ScheduleInterleaved1F1B(stages, n_mb, args_batch_dim=[0])
    params = [p for st in stages for p in st.submodule.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    losses, outs, rs = [], [], []
    dp_rank = mesh["dp_shard"].get_local_rank() if dp > 1 else 0
    for step in range(STEPS):
        x, y = _batch(step, ARGS)
        lo, hi = dp_rank * len(x) // dp, (dp_rank + 1) * len(x) // dp
        comm = hp.CommDebugMode() if step > 0 and dp > 1 else contextlib.nullcontext()
        with comm:
            out = sched.run(x[lo:hi], labels=y[lo:hi])
        if step > 0 and dp > 1:
            rs.append(comm.get_comm_counts().get("reduce_scatter", 0))
        outs.append(None if out is None else tuple(out.shape))
        if out is not None:
            losses.append(_full(out).sum().item())
        _clip_global(params, CLIP, mesh["pp"].get_group())
        if step == STEPS - 1:
            grads = {n[2:]: _full(p.grad).clone() for st in stages for n, p in st.submodule.named_parameters()}
        opt.step()
        opt.zero_grad()
    state = {n[2:]: _full(v).detach().clone() for st in stages for n, v in st.submodule.state_dict().items()}
    order = sched.exec_order
    mine = [st.stage_index for st in stages]
    kinds = sorted({(m.type.name, m.stage_index) for m in order[mesh["pp"].get_local_rank()]
                    if m is not None and m.stage_index is not None})
    return dict(losses=losses, state=state, grads=grads, outs=outs, stages=mine, kinds=kinds, rs=rs,
                torch_stage=type(stages[0].stage).__name__)


def _check(res):
    ref_losses, ref_state, ref_grads = _reference(ARGS)
    state, grads, losses = {}, {}, []
    for r in res:
        state.update(r["state"])
        grads.update(r["grads"])
        if r["losses"]:
            losses.append(r["losses"])
    assert set(state) == set(ref_state) and set(grads) == set(ref_grads)
    got = torch.tensor(losses, dtype=torch.float64).mean(0)  # dp ranks: mean of their shards' losses
    torch.testing.assert_close(got, torch.tensor(ref_losses, dtype=torch.float64), **TOL)
    for n in ref_state:
        torch.testing.assert_close(state[n], ref_state[n], **TOL, msg=f"parameter {n}")
        torch.testing.assert_close(grads[n], ref_grads[n], **TOL, msg=f"gradient {n}")


def test_hp_api_two_stages_tp_dtensor(dist_runner):
    """2 stages x TP 2 (4 ranks), Schedule1F1B, the pipeline group from HyperParallel's rank arithmetic."""
    res = dist_runner.run(4, _hp_train, 1, 2, 4, False)
    _check(res)
    for r in res:
        assert r["torch_stage"] == "PipelineStage"
        # run returns the 4 microbatch losses stacked, on the last stage only
        assert r["outs"] == ([(4,)] * STEPS if r["stages"] == [1] else [None] * STEPS), r
        assert ("FWD", r["stages"][0]) in r["kinds"] and ("BWD", r["stages"][0]) in r["kinds"]


def test_hp_api_four_stages_interleaved(dist_runner):
    """4 stages, 2 per rank (looped), ScheduleInterleaved1F1B on a 1-D HyperParallel pp mesh."""
    res = dist_runner.run(2, _hp_train, 2, 1, 4, True)
    assert [r["stages"] for r in res] == [[0, 2], [1, 3]]
    _check(res)


def test_meta_step_and_batch_dim_spec():
    a = hpp.MetaStep(0, hpp.MetaStepType.FWD, 1)
    assert a == hpp.MetaStep(0, hpp.MetaStepType.FWD, 1) and a != hpp.MetaStep(1, hpp.MetaStepType.FWD, 1)
    assert "FWD" in repr(a) and hash(a) == hash(hpp.MetaStep(0, hpp.MetaStepType.FWD, 1))
    assert hpp.BatchDimSpec.from_tuple((0, 1)) == (hpp.BatchDimSpec(0), hpp.BatchDimSpec(1))
    assert hpp.BatchDimSpec.from_dict({"x": 1}) == {"x": hpp.BatchDimSpec(1)}
    with pytest.raises(TypeError, match="batch_dim"):
        hpp.BatchDimSpec(1.5)
    with pytest.raises(TypeError, match="meta_type"):
        hpp.MetaStep(0, "FWD", 0)


def _hp_bad_inputs():
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    (s, m), = pp.split_into_stages(_model(ARGS), mesh, schedule="1F1B")
    errs = []

    def expect(exc, fn, *needles):
        with pytest.raises(exc) as e:
            fn()
        for n in needles:
            assert n in str(e.value), (n, str(e.value))
        errs.append(str(e.value))

    expect(ValueError, lambda: hpp.PipelineStage(m, 2, 2), "stage_index=2", "stage_num=2")
    expect(ValueError, lambda: hpp.PipelineStage(m, s, 2, dyn_shape=True), "dyn_shape")
    expect(ValueError, lambda: hpp.PipelineStage(m, s, 2, src_stage=5), "src_stage=5")
    # a stage count that does not match the mesh: 3 stages, one per rank, on a 2-rank pp mesh
    expect(ValueError, lambda: hpp.Schedule1F1B(hpp.PipelineStage(m, s, 3, mesh=mesh), 4), "stage_num=3", "2")
    expect(ValueError, lambda: hpp.ScheduleGPipe(hpp.PipelineStage(m, s, 2, mesh=mesh), 0), "micro_batch_num", "0")
    expect(ValueError, lambda: hpp.Schedule1F1B(hpp.PipelineStage(m, s, 2, mesh=mesh), 1), "n_microbatches=1")
    expect(TypeError, lambda: hpp.ScheduleGPipe([m], 2), "stages")
    return len(errs)


def test_hp_api_bad_inputs(dist_runner):
    assert dist_runner.run(2, _hp_bad_inputs) == [7, 7]


def test_hp_api_with_fully_shard_stages(dist_runner):
    """2 stages x dp_shard 2 with fully_shard on the blocks and the stage root: parity, and every group
    reduce-scatters once per step (not once per microbatch), as with the PyTorch-style API."""
    res = dist_runner.run(4, _hp_train, 1, 1, 4, True, 2)
    _check(res)
    for r in res:
        groups = 2 + 1  # 2 blocks per stage (4 blocks + embedding + head over 2 stages) + the root
        assert r["rs"] == [groups] * 2, r["rs"]
