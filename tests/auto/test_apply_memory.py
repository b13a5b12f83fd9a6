"""hyper_parallel.auto on 4 gloo ranks: Plan.apply (also context parallelism, and pipelines x tp / cp / ep / AC:
the schedule) trains like one process (loss, gradients, one AdamW step,
float64), and the predicted parameter + gradient + optimizer bytes equal the measured local shards exactly
(the maximum over ranks)."""
import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from examples.llama.configs import get_config
from examples.llama.data import TokenBatches
from examples.llama.model import build_model, loss_fn

DT = torch.float64
TOL = dict(rtol=1e-9, atol=1e-11)

LAYOUTS = [  # (config, degrees, sp, ac)
    ("tiny", {"fsdp": 4}, False, "none"),
    ("tiny", {"dp": 4}, False, "none"),
    ("tiny", {"dp": 2, "fsdp": 2}, False, "none"),
    ("tiny", {"fsdp": 2, "tp": 2}, True, "none"),
    ("tiny", {"dp": 2, "tp": 2}, False, "none"),
    ("tiny", {"fsdp": 2, "tp": 2}, True, "full"),
    ("tiny", {"fsdp": 4}, False, "full"),
    ("moe-tiny", {"fsdp": 4, "ep": 2}, False, "none"),
    ("moe-tiny", {"fsdp": 2, "tp": 2}, True, "none"),
    ("moe-tiny", {"fsdp": 4, "ep": 4}, False, "none"),
    ("renamed", {"fsdp": 2, "tp": 2}, True, "none"),   # other names, nn.LayerNorm / nn.RMSNorm, ModuleList
    ("renamed", {"dp": 2, "tp": 2}, False, "full"),
    # context parallelism (load-balanced sequence shards; gradients reduced over dp/fsdp x cp)
    ("tiny", {"fsdp": 2, "cp": 2}, False, "none"),
    ("tiny", {"cp": 2, "tp": 2}, True, "none"),
    ("tiny", {"dp": 2, "cp": 2}, False, "full"),
    ("tiny", {"cp": 4, "cp_method": "ulysses"}, False, "none"),
    ("renamed", {"fsdp": 2, "cp": 2}, False, "none"),
    # selective activation checkpointing (matmul and attention outputs saved, the rest recomputed)
    ("tiny", {"fsdp": 4}, False, "selective"),
    ("tiny", {"fsdp": 2, "tp": 2}, True, "selective"),
    ("moe-tiny", {"fsdp": 4, "ep": 2}, False, "selective"),
    ("renamed", {"dp": 2, "tp": 2}, False, "selective"),
]


def _config(name):
    if name == "renamed":
        from types import SimpleNamespace
        from tests.auto.models import build_renamed
        return SimpleNamespace(seed=0, global_batch=8, seq_len=16, build=lambda: build_renamed(0).to(DT),
                               vocab=96)
    cfg = get_config(name)
    cfg.build = lambda: build_model(cfg.model, cfg.seed).to(DT)
    cfg.vocab = cfg.model.vocab_size
    return cfg


def _batch(cfg):
    x, y = TokenBatches(seed=cfg.seed).get_batch(0, cfg.global_batch, cfg.seq_len)
    return x % cfg.vocab, y % cfg.vocab


def _local(t):
    return t.to_local() if isinstance(t, hp.DTensor) else t


def _full(t):
    return (t.full_tensor() if isinstance(t, hp.DTensor) else t).detach().clone()


def _reference(cfg):
    model = cfg.build()
    x, y = _batch(cfg)
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    return loss.item(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _body(case):
    from hyper_parallel.auto import Cluster, evaluate_plan
    name, degrees, sp, ac = LAYOUTS[case]
    degrees = dict(degrees)
    cp_method = degrees.pop("cp_method", None)
    cfg = _config(name)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = cfg.build()
    plan = evaluate_plan(model, Cluster(world, world, "1GiB"), degrees=degrees, global_batch=cfg.global_batch,
                         seq_len=cfg.seq_len, sequence_parallel=sp, activation_checkpointing=ac, cp_method=cp_method)
    model = plan.apply(model)
    x, y = plan.shard_batch(*_batch(cfg))
    loss = loss_fn(model(x), y)
    loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    nbytes = 0
    for p in model.parameters():
        nbytes += _local(p).numel() * _local(p).element_size()
        nbytes += _local(p.grad).numel() * _local(p.grad).element_size()
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                nbytes += _local(v).numel() * _local(v).element_size()
    measured = torch.tensor([nbytes])
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    l = _local(loss).detach().clone()
    dist.all_reduce(l)
    l /= world
    grads = {k: _full(p.grad) for k, p in model.named_parameters()}
    params = {k: _full(p.detach()) for k, p in model.named_parameters()}
    return dict(predicted=plan.state_max, measured=int(measured.item()), loss=l.item(),
                grads=grads if rank == 0 else None, params=params if rank == 0 else None)


@pytest.mark.parametrize("case", range(len(LAYOUTS)), ids=[f"{c}-{'x'.join(f'{k}{v}' for k, v in d.items())}"
                                                          f"{'-sp' if sp else ''}-ac{ac}" for c, d, sp, ac in LAYOUTS])
def test_apply_parity_and_exact_state_bytes(dist_runner, case):
    out = dist_runner.run(4, _body, case)
    name = LAYOUTS[case][0]
    ref_loss, ref_grads, ref_params = _reference(_config(name))
    assert out[0]["predicted"] == out[0]["measured"], out[0]
    assert all(o["measured"] == out[0]["measured"] for o in out)
    assert abs(out[0]["loss"] - ref_loss) < 1e-10
    for k, g in ref_grads.items():
        torch.testing.assert_close(out[0]["grads"][k], g, **TOL, msg=lambda m: f"grad {k}: {m}")
        torch.testing.assert_close(out[0]["params"][k], ref_params[k], **TOL, msg=lambda m: f"param {k}: {m}")


PP_LAYOUTS = [  # (config, degrees, schedule, microbatches, sp, ac)
    ("tiny", {"pp": 2, "fsdp": 2}, "1f1b", 2, False, "none"), ("tiny", {"pp": 2, "fsdp": 2}, "gpipe", 4, False, "none"),
    ("moe-tiny", {"pp": 2, "fsdp": 2}, "gpipe", 2, False, "none"),
    ("demo", {"pp": 2, "fsdp": 2}, "interleaved1f1b", 2, False, "none"),
    # pipeline x tp / cp / ep / AC
    ("tiny", {"pp": 2, "tp": 2}, "1f1b", 2, True, "none"), ("tiny", {"pp": 2, "tp": 2}, "gpipe", 4, False, "none"),
    ("demo", {"pp": 2, "tp": 2}, "interleaved1f1b", 2, True, "none"),
    ("tiny", {"pp": 2, "cp": 2}, "1f1b", 2, False, "none"), ("tiny", {"pp": 2, "fsdp": 2}, "1f1b", 2, False, "full"),
    ("moe-tiny", {"pp": 2, "fsdp": 2, "ep": 2}, "gpipe", 2, False, "none"),
    ("demo", {"pp": 4}, "gpipe", 4, False, "none"),
    ("tiny", {"pp": 2, "tp": 2}, "1f1b", 2, True, "selective"),
    # data parallelism by replication with a pipeline (Megatron's layout): one gradient all_reduce per step
    ("tiny", {"pp": 2, "dp": 2}, "1f1b", 4, False, "none"), ("demo", {"pp": 2, "dp": 2}, "gpipe", 2, False, "full"),
    # Megatron's block recompute: only the first block of every stage checkpointed
    ("demo", {"pp": 2, "fsdp": 2}, "1f1b", 2, False, "full:1"),
]


PP8_LAYOUTS = [  # on 8 ranks: tp x cp x pp (Llama 3's long-context layout)
    ("tiny", {"pp": 2, "cp": 2, "tp": 2}, "1f1b", 2, True, "none"),
]


def _pp_body(case, layouts="PP_LAYOUTS"):
    from hyper_parallel.auto import Cluster, evaluate_plan
    from hyper_parallel.pipelining import clip_grad_norm_  # noqa: F401  (the schedule's companion)
    name, degrees, sched, m, sp, ac = globals()[layouts][case]
    cfg = _config(name)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = cfg.build()
    plan = evaluate_plan(model, Cluster(world, world, "1GiB"), degrees=degrees, global_batch=cfg.global_batch,
                         seq_len=cfg.seq_len, pp_schedule=sched, microbatches=m, sequence_parallel=sp,
                         activation_checkpointing=ac.split(":")[0],
                         recompute_layers=int(ac.split(":")[1]) if ":" in ac else None)
    schedule = plan.apply(model)
    x, y = plan.shard_batch(*_batch(cfg))
    losses = []
    schedule.step(*((x,) if schedule.has_first else ()), target=y if schedule.has_last else None, losses=losses)
    params = [p for mod in schedule.stage_modules for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    nbytes = sum(_local(t).numel() * _local(t).element_size() for p in params
                 for t in [p, p.grad] + [v for v in opt.state[p].values() if v.dim() > 0])
    measured = torch.tensor([nbytes])
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    loss = torch.stack([_local(l).detach() for l in losses]).mean() if losses else torch.zeros((), dtype=DT)
    dist.all_reduce(loss)
    out = {k: _full(p.detach()) for mod in schedule.stage_modules for k, p in mod.named_parameters()}
    grads = {k: _full(p.grad) for mod in schedule.stage_modules for k, p in mod.named_parameters()}
    return dict(loss=loss.item() / (world // plan.degrees["pp"]), params=out, grads=grads, predicted=plan.state_max,
                measured=int(measured.item()))


@pytest.mark.parametrize("case", range(len(PP_LAYOUTS)),
                         ids=[f"{c}-{'x'.join(f'{k}{v}' for k, v in d.items())}-{s}-m{m}{'-sp' if sp else ''}-ac{ac}"
                              for c, d, s, m, sp, ac in PP_LAYOUTS])
def test_apply_pipeline_returns_a_schedule_with_parity(dist_runner, case):
    _check_pp(dist_runner.run(4, _pp_body, case), PP_LAYOUTS[case][0])


@pytest.mark.parametrize("case", range(len(PP8_LAYOUTS)))
def test_apply_pipeline_tp_cp_pp_on_8_ranks(dist_runner, case):
    _check_pp(dist_runner.run(8, _pp_body, case, "PP8_LAYOUTS"), PP8_LAYOUTS[case][0])


def _check_pp(out, name):
    ref_loss, ref_grads, ref_params = _reference(_config(name))
    assert abs(out[0]["loss"] - ref_loss) < 1e-10, (out[0]["loss"], ref_loss)
    assert out[0]["predicted"] == out[0]["measured"]  # exact for these balanced stage splits too
    seen = set()
    for o in out:
        for k, v in o["params"].items():
            torch.testing.assert_close(o["grads"][k], ref_grads[k], **TOL, msg=lambda m: f"grad {k}: {m}")
            torch.testing.assert_close(v, ref_params[k], **TOL, msg=lambda m: f"param {k}: {m}")
            seen.add(k)
    assert seen == set(ref_params)
