"""examples/llama/train.py with --pp and --cp: context parallelism inside pipeline stages, against one process.

* Through the trainer's own functions (``examples/llama/pipeline.train_pipeline``, the loop ``train.py
  --pp 2 --cp 2`` runs, flags parsed by ``train.parse_args``) in float64 on 4 ranks, mesh
  ("pp", "dp_shard", "cp", "tp") = (2, 1, 2, 1): ``ContextParallel(ring)`` on each stage's attention, the
  first stage fed cp-sharded tokens, the last stage's loss on cp-sharded labels with the CP scaling
  (``cp * local sum / N`` per microbatch, then torch's mean over the 1F1B schedule's 4 microbatches),
  each stage's gradients reduced over cp by ``fully_shard`` over the flattened (dp_shard, cp) dims:
  3 AdamW steps with the pipeline's ``clip_grad_norm_``; losses, every parameter and every (clipped)
  gradient of the last step equal one process training the whole batch (1e-10).
* What stays refused names the flag and value: V schedules, other cp methods, --tp/--sp, --compile,
  --ep.
"""
import re

import pytest
import torch
import torch.distributed as dist

from examples.llama.configs import get_config
from examples.llama.model import build_model
from tests.pipelining.test_pipelining_train import STEPS, TOL, _full, _reference


def _train_body(flags):
    from examples.llama import pipeline, train
    args = train.parse_args(["--config", "tiny", *flags])
    cfg = get_config("tiny")
    pipeline.check_args(args, cfg, dist.get_world_size())
    mesh = train.make_mesh(args)
    assert mesh.mesh_dim_names == ("pp", "dp_shard", "cp", "tp")
    losses, module, _ = pipeline.train_pipeline(args, STEPS, cfg, mesh, log=lambda *a, **k: None,
                                                model=build_model(cfg.model, cfg.seed).double())
    # the sequence really was sharded: this rank's rotary tables hold seq_len / cp positions
    local_rope = module.rope_cos.shape[0]
    params = {n: _full(p).detach().clone() for n, p in module.named_parameters()}
    grads = {n: _full(p.grad).clone() for n, p in module.named_parameters()}
    return losses, params, grads, local_rope


def test_pp2_cp2_ring_trainer_matches_one_process(dist_runner):
    flags = ("--pp", "2", "--cp", "2", "--cp-method", "ring", "--pp-schedule", "1f1b", "--pp-microbatches", "4")
    res = dist_runner.run(4, _train_body, flags)
    cfg = get_config("tiny")
    ref_losses, ref_params, ref_grads = _reference(cfg)
    params, grads = {}, {}
    for losses, p, g, local_rope in res:  # every rank reports the global loss
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
        assert local_rope == cfg.seq_len // 2, local_rope
        params.update(p)
        grads.update(g)
    assert set(params) == set(ref_params), sorted(set(params) ^ set(ref_params))
    for n in ref_params:
        torch.testing.assert_close(params[n], ref_params[n], **TOL, msg=f"parameter {n}")
        torch.testing.assert_close(grads[n], ref_grads[n], **TOL, msg=f"gradient {n}")


def test_cp_pp_refused_combinations_name_flag_and_value():
    from examples.llama import pipeline, train
    cfg = get_config("tiny")
    cases = {("--pp", "2", "--cp", "2", "--pp-schedule", "zbv"): "--cp 2 with --pp-schedule zbv",
             ("--pp", "2", "--cp", "2", "--pp-schedule", "dualpipev"): "--cp 2 with --pp-schedule dualpipev",
             ("--pp", "2", "--cp", "2", "--cp-method", "ulysses"): "--cp-method ulysses",
             ("--pp", "2", "--cp", "2", "--cp-method", "hybrid"): "--cp-method hybrid",
             ("--pp", "2", "--cp", "2", "--tp", "2"): "--tp 2 is not supported",
             ("--pp", "2", "--cp", "2", "--sp"): "--sp is not supported",
             ("--pp", "2", "--cp", "2", "--compile", "eager"): "--compile is not supported with --cp 2"}
    for flags, needle in cases.items():
        with pytest.raises(SystemExit, match=re.escape(needle)):
            pipeline.check_args(train.parse_args(list(flags)), cfg, 4)
    assert pipeline.check_args(train.parse_args(["--pp", "2", "--cp", "2"]), cfg, 4) == (2, 2)
    # --ep stays refused with --cp (train.main checks before any process group exists)
    with pytest.raises(SystemExit, match=re.escape("--cp 2 with --ep 2 is not supported")):
        train.main(["--config", "moe-tiny", "--cp", "2", "--ep", "2", "--dp-shard", "2"])
