"""examples/llama/train.py with --pp: the pipeline trainer against one process.

* Through the trainer's own functions (``examples/llama/pipeline.train_pipeline``, the loop
  ``train.py --pp`` runs, with its flags parsed by ``train.parse_args``) in float64: 3 AdamW steps
  with ``hyper_parallel.pipelining.clip_grad_norm_`` under ``--pp 2 --pp-schedule 1f1b``,
  ``--pp 2 --tp 2 --sp``, ``--pp 2 --dp-shard 2``, ``--pp 2 --pp-schedule zbv`` and
  ``--pp 2 --pp-schedule interleaved1f1b --pp-layers-per-stage 1``: losses, every parameter and
  every (clipped) gradient of the last step equal one process training the whole batch (1e-10).
* ``train.py --pp 2`` under torchrun (as a user runs it): exit 0, the bubble in the progress line,
  the printed loss difference against the single-process run.
* ``clip_grad_norm_`` alone: the norm over two pipeline ranks' gradients (plain and DTensor) is
  the whole model's, for norm 2 and inf, and bad arguments name themselves.
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import pipelining as pp
from examples.llama.configs import get_config
from examples.llama.data import TokenBatches
from examples.llama.model import build_model, loss_fn
from examples.llama.reference import build_optimizer
from tests.harness.launch import run_launch

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
TOL = dict(rtol=1e-10, atol=1e-10)


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


def _reference(cfg):
    model = build_model(cfg.model, cfg.seed).double()
    opt = build_optimizer(model.parameters(), cfg.optim)
    data, losses = TokenBatches(seed=cfg.seed), []
    for step in range(STEPS):
        x, y = data.get_batch(step, cfg.global_batch, cfg.seq_len)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return (losses, {n: p.detach().clone() for n, p in model.named_parameters()},
            {n: p.grad.clone() for n, p in model.named_parameters()})


def _train_body(flags):
    from examples.llama import pipeline, train
    args = train.parse_args(["--config", "tiny", *flags])
    cfg = get_config("tiny")
    pipeline.check_args(args, cfg, dist.get_world_size())
    mesh = train.make_mesh(args)
    losses, module, _ = pipeline.train_pipeline(args, STEPS, cfg, mesh, log=lambda *a, **k: None,
                                                model=build_model(cfg.model, cfg.seed).double())
    named = [(n.replace("._orig_mod", ""), p) for n, p in module.named_parameters()]  # compiled blocks
    params = {n: _full(p).detach().clone() for n, p in named}
    grads = {n: _full(p.grad).clone() for n, p in named}
    return losses, params, grads


CASES = {  # flags -> world size
    ("--pp", "2", "--pp-schedule", "1f1b", "--pp-microbatches", "4"): 2,
    ("--pp", "2", "--tp", "2", "--sp"): 4,
    ("--pp", "2", "--dp-shard", "2", "--pp-microbatches", "2"): 4,
    ("--pp", "2", "--pp-schedule", "zbv", "--pp-microbatches", "4"): 2,
    ("--pp", "2", "--tp", "2", "--pp-schedule", "zbv", "--pp-microbatches", "4"): 4,  # split weight pass, TP DTensors
    ("--pp", "2", "--pp-schedule", "interleaved1f1b", "--pp-layers-per-stage", "1"): 2,
    ("--pp", "2", "--tp", "2", "--sp", "--compile", "aot_eager"): 4,  # compiled blocks inside TP + SP stages
}


@pytest.mark.parametrize("flags", list(CASES), ids=lambda f: "_".join(a.strip("-") for a in f))
def test_pipeline_trainer_matches_one_process(dist_runner, flags):
    res = dist_runner.run(CASES[flags], _train_body, flags)
    ref_losses, ref_params, ref_grads = _reference(get_config("tiny"))
    for losses, _, _ in res:  # every rank reports the global loss
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    params, grads = {}, {}
    for _, p, g in res:
        params.update(p)
        grads.update(g)
    assert set(params) == set(ref_params), sorted(set(params) ^ set(ref_params))
    for n in ref_params:
        torch.testing.assert_close(params[n], ref_params[n], **TOL, msg=f"parameter {n}")
        torch.testing.assert_close(grads[n], ref_grads[n], **TOL, msg=f"gradient {n}")


def test_train_py_pp2_under_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples/llama/train.py"), "--pp", "2", "--pp-schedule", "gpipe", "--pp-microbatches", "4",
           "--config", "tiny", "--steps", "2", "--out", str(tmp_path / "loss")]
    try:
        proc = run_launch(cmd, cwd=ROOT, env=env, timeout=300)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"train.py --pp 2 did not finish within 300s:\n{exc.stdout}\n{exc.stderr}")
    out = proc.stdout
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "pp=2 (GPipe, 2 stages, 4 microbatches)" in out, out
    m = re.search(r"step 2/2 +loss \d+\.\d{4} +[\d,]+ tok/s +bubble (\d+)% \(ranks (\d+)%-(\d+)%\)", out)
    assert m and 0 <= int(m.group(2)) <= int(m.group(1)) <= int(m.group(3)) <= 100, out
    m = re.search(r"largest loss difference vs single process: (\S+) \(relative (\S+)\)", out)
    assert m and float(m.group(1)) < 1e-5, out
    assert (tmp_path / "loss.csv").is_file()


def _clip_body(norm_type):
    """pp 2 x tp 2: each pipeline rank holds half of a model's parameters, one a plain tensor and one a
    Shard(0) DTensor on mesh["tp"]: the total norm and the clipped gradients equal torch's over all of them."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(6, 4, generator=g, dtype=torch.float64) * 3 for _ in range(4)]
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    for p in ref:
        p.grad = p.detach().clone() * 2
    want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=norm_type)
    pp_rank = mesh.get_local_rank("pp")
    mine = []
    for k, i in enumerate((0, 1) if pp_rank == 0 else (2, 3)):
        t = hp.distribute_tensor(full[i], mesh["tp"], [hp.Shard(0)]) if k == 0 else full[i].clone()
        p = torch.nn.Parameter(t)
        p.grad = p.detach().clone() * 2
        mine.append(p)
    got = pp.clip_grad_norm_(mine, 1.0, norm_type=norm_type, pp_group=mesh["pp"])
    torch.testing.assert_close(got, want.to(got.dtype), **TOL)
    for p, q in zip(mine, ref[0:2] if pp_rank == 0 else ref[2:4]):
        torch.testing.assert_close(_full(p.grad), q.grad, **TOL)
    # without pp_group each rank clips by its own norm: not the whole model's
    assert not torch.allclose(pp.get_total_norm([p.grad for p in mine], norm_type), got)
    for kw, needle in ((dict(max_norm=1.0, norm_type=-1.0), "norm_type"),
                       (dict(max_norm=1.0, pp_group=mesh), "pp_group"), (dict(max_norm="x"), "max_norm")):
        with pytest.raises(ValueError, match=needle):
            pp.clip_grad_norm_(mine, **kw)
    return float(got)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_over_pipeline_ranks(dist_runner, norm_type):
    res = dist_runner.run(4, _clip_body, norm_type)
    assert len(set(res)) == 1, res


def test_pp_flags_bad_input_name_flag_and_value():
    from examples.llama import pipeline, train
    cfg = get_config("tiny")   # 2 blocks, global batch 8
    cases = {("--pp", "2", "--dp", "2"): "--dp 2", ("--pp", "2", "--loss-parallel"): "--loss-parallel",
             ("--pp", "2", "--pp-microbatches", "3"): "--pp-microbatches 3",
             ("--pp", "2", "--pp-layers-per-stage", "1"): "makes 4 stages for --pp 2",
             ("--pp", "2", "--pp-schedule", "zbv", "--pp-layers-per-stage", "4"): "needs exactly 2 stages per rank",
             ("--pp", "2", "--pp-schedule", "zbv", "--compile"): "refuses compiled stages",
             ("--pp", "2", "--dp-shard", "2", "--pp-schedule", "zbv"): "does not compose with --dp-shard 2"}
    for flags, needle in cases.items():
        with pytest.raises(SystemExit, match=re.escape(needle)):
            pipeline.check_args(train.parse_args(list(flags)), cfg, 4)
    assert pipeline.check_args(train.parse_args(["--pp", "2", "--pp-schedule", "interleaved1f1b"]), cfg, 2) == (4, 4)
