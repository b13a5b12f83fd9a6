"""The example MoE model pipelined with expert parallelism inside each stage, against one process.

``train.py --config moe-tiny --pp 2 --dp-shard 2 --ep 2`` (4 ranks, mesh ``("pp", "efsdp", "ep",
"tp")`` = 2 x 1 x 2 x 1, 1F1B, 2 microbatches per step), run through the trainer's own functions
(``train.parse_args``, ``train.make_mesh``, ``pipeline.train_pipeline``) in float64 for 3 AdamW steps
with the pipeline-wide gradient clip and the aux-loss-free expert-bias step: every step's loss, every
MoE layer's GLOBAL expert counts of every step (summed over both microbatches and both ep ranks of
the stage that holds the layer), and the final parameters and expert biases equal one process
training the whole batch (tests/moe/test_moe_training.py's reference) to 1e-10.

Three cases: moe-tiny (softmax, aux-loss-free balancing only) under 1F1B with 2 microbatches and
under Interleaved1F1B (2 stages per rank), and tests/moe/test_moe_training.py's DeepSeek-style variant
(sigmoid, group-limited routing, route_norm, the sequence-wise aux loss) under GPipe with 4
microbatches of one sequence each: the aux loss's gradient, added once per microbatch and scaled by
1/microbatches with the rest, is the one process's. Also the flag refusals that remain (--ep with
--pp and --tp; with the zero-bubble schedules).
"""
import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from examples.llama.model import build_model
from examples.llama.moe import format_load
from tests.moe.test_moe_training import STEPS, TOL, _cfg, _float64, _reference

FLAGS = ["--config", "moe-tiny", "--pp", "2", "--dp-shard", "2", "--ep", "2"]
CASES = {  # name: (tests/moe/test_moe_training.py variant, extra flags)
    "tiny_1f1b_mb2": ("tiny", []),
    # sigmoid, group-limited routing, route_norm and the sequence-wise aux loss, one sequence per microbatch
    "ds_gpipe_mb4": ("ds", ["--pp-schedule", "gpipe", "--pp-microbatches", "4"]),
    # looped: 4 stages (embedding + block 0 | block 1 | block 2 | norm + output), 2 per rank
    "tiny_interleaved1f1b": ("tiny", ["--pp-schedule", "interleaved1f1b"]),
}


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


def _body(variant, flags):
    from examples.llama import pipeline, train
    with _float64():
        args = train.parse_args(FLAGS + flags)
        cfg = _cfg(variant)
        pipeline.check_args(args, cfg, dist.get_world_size())
        mesh = train.make_mesh(args)
        lines = []
        losses, module, _ = pipeline.train_pipeline(args, STEPS, cfg, mesh, log=lambda *a, **k: lines.append(a),
                                                    model=build_model(cfg.model, cfg.seed))
        for name, m in module.named_modules():  # the experts of this stage are split over ep
            if name.endswith("moe.experts"):
                assert isinstance(m.w1, hp.DTensor) and m.w1.to_local().shape[0] == 8 // 2, name
        state = {n: _full(p).detach().clone() for n, p in module.named_parameters()}
        state.update({n: b.detach().clone() for n, b in module.named_buffers() if n.endswith("expert_bias")})
        loads = [str(a[2]).strip() for a in lines if a[0] is None and "expert load" in str(a[2])]
    return losses, loads, state


@pytest.mark.parametrize("name", list(CASES))
def test_moe_pipeline_ep2_pp2_matches_one_process(dist_runner, name):
    variant, flags = CASES[name]
    threads = torch.get_num_threads()
    try:
        ref_losses, ref_counts, ref_state = _reference(variant, STEPS)
    finally:
        torch.set_num_threads(threads)
    ref_loads = [f"step {i + 1} {format_load({k: torch.tensor(v) for k, v in c.items()})}"
                 for i, c in enumerate(ref_counts)]
    res = dist_runner.run(4, _body, variant, flags, timeout=240)
    state = {}
    for losses, loads, st in res:
        for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):  # every rank: the global loss
            assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs one process {b}"
        # global counts of both MoE layers (on different stages), every step: the same routing as one process
        assert loads == ref_loads, (loads, ref_loads)
        state.update(st)
    assert sorted(state) == sorted(ref_state), sorted(set(state) ^ set(ref_state))
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=TOL, atol=TOL, msg=k)
    assert state["layers.2.moe.expert_bias"].abs().sum() > 0


def test_moe_pipeline_bad_flags():
    from examples.llama import pipeline, train
    with pytest.raises(SystemExit, match="--ep 2 with --pp 2 composes with --dp-shard only; --tp 2"):
        train.main([*FLAGS, "--tp", "2"])
    for schedule in ("zbv", "dualpipev"):
        with pytest.raises(SystemExit, match=f"--pp-schedule {schedule} does not compose with --dp-shard 2 / --ep 2"):
            pipeline.check_args(train.parse_args([*FLAGS, "--pp-schedule", schedule]), _cfg("tiny"), 4)
