"""The training loop of the Hugging Face example: a plan (or one process), AdamW, loss and gradient norm per step.

``train_parallel`` runs on every rank of a launched world: it builds the model, applies the plan
(``Plan.apply``), feeds each global batch through ``Plan.shard_batch`` and returns, per step, the
global mean loss and the global gradient norm. ``train_reference`` is the same steps in one process.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch
import torch.distributed as dist

from examples.hf.presets import batch, build_model, logits_of, loss_fn, vocab_size


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _sq_norm(grads) -> float:
    """Sum of squares of the gradients (local tensors of DTensors count once per distinct shard: the caller
    reduces over the ranks that hold distinct pieces)."""
    total = 0.0
    for g in grads:
        full = g.full_tensor() if hasattr(g, "full_tensor") else g
        total += float(full.double().pow(2).sum())
    return total


def train_reference(config: str, *, steps: int, global_batch: int, seq_len: int, lr: float = 1e-3,
                    seed: int = 0, dtype=torch.float64) -> List[Tuple[float, float]]:
    """(loss, gradient norm) per step of ``steps`` AdamW steps in one process."""
    model = build_model(config, seed, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    vocab, out = vocab_size(model), []
    for step in range(steps):
        x, y = batch(seed, step, global_batch, seq_len, vocab)
        loss = loss_fn(model(x), y)
        loss.backward()
        norm = math.sqrt(_sq_norm(p.grad for p in model.parameters() if p.grad is not None))
        opt.step()
        opt.zero_grad()
        out.append((loss.item(), norm))
    return out


def train_parallel(config: str, plan, *, steps: int, lr: float = 1e-3, seed: int = 0, dtype=torch.float64,
                   roles=None) -> List[Tuple[float, float]]:
    """(global mean loss, global gradient norm) per step of ``plan`` applied to the model (every rank)."""
    model = build_model(config, seed, dtype)
    vocab = vocab_size(model)
    applied = plan.apply(model, roles=roles, loss_fn=loss_fn)
    pipeline = plan.degrees["pp"] > 1
    modules = applied.stage_modules if pipeline else [applied]
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr)
    world, out = dist.get_world_size(), []
    for step in range(steps):
        x, y = plan.shard_batch(*batch(seed, step, plan.global_batch, plan.seq_len, vocab))
        if pipeline:
            losses = []
            applied.step(*((x,) if applied.has_first else ()), target=y if applied.has_last else None, losses=losses)
            loss = torch.stack([_local(l).detach() for l in losses]).mean() if losses else torch.zeros((), dtype=dtype)
            share = world // plan.degrees["pp"]  # the last stage's ranks hold the losses
        else:
            loss = loss_fn(applied(x), y)
            loss.backward()
            loss, share = _local(loss).detach(), world
        total = loss.detach().clone().double().reshape(1)
        dist.all_reduce(total)
        # every parameter's gradient is whole (full_tensor) on every rank of its stage; stages hold disjoint ones
        sq = torch.tensor([_sq_norm(p.grad for p in params if p.grad is not None)], dtype=torch.float64)
        if pipeline:
            sq *= plan.degrees["pp"] / world  # sum over stages: each stage's ranks all hold its whole gradients
        else:
            sq /= world
        dist.all_reduce(sq)
        opt.step()
        opt.zero_grad()
        out.append((total.item() / share, math.sqrt(sq.item())))
    return out


def moe_roles(model) -> dict:
    """``roles=`` for HF MoE layers: each experts module and its router (a sibling leaf with a 2-D ``[E, dim]``
    weight), for a planner that does not recognise them."""
    from hyper_parallel.auto.hf_experts import is_hf_experts
    out = {}
    for name, mod in model.named_modules():
        if not is_hf_experts(mod):
            continue
        out[name] = "experts"
        parent = name.rpartition(".")[0]
        for child, sub in model.get_submodule(parent).named_children():
            if sub is not mod and not list(sub.children()) and any(p.dim() == 2 for p in sub.parameters()):
                out[f"{parent}.{child}"] = "router"
    return out


def _plan_hf(fn, model, config):
    """``fn(model, **kw)`` (``plan`` / ``evaluate_plan``) on an HF model; a planner that does not read HF outputs or
    MoE blocks yet gets the loss of the logits, the experts' roles, and MoE models traced in bfloat16 with
    torch's grouped matmul (its meta kernel needs it)."""
    try:
        return fn(model)
    except (AttributeError, NotImplementedError, RuntimeError, ValueError) as first:
        roles = moe_roles(model) or None
        if roles:
            model = build_model(config, 0, torch.bfloat16)
        try:
            return fn(model, roles=roles, loss=lambda out: logits_of(out).float().sum())
        except Exception as second:
            raise second from first


def choose_plan(config: str, world: int, *, global_batch: int, seq_len: int, device_memory="4GiB"):
    """The planner's best layout for the model of ``config`` on the launched world (call on every rank: the
    cluster is calibrated with collectives, every rank gets the same numbers and so the same plan)."""
    import os
    from hyper_parallel.auto import Cluster, plan
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cluster = Cluster(world, per_node, device_memory).measure()
    model = build_model(config, 0, torch.float32)
    return _plan_hf(lambda m, **kw: plan(m, cluster, global_batch=global_batch, seq_len=seq_len,
                                         activation_checkpointing="none", top_k=1, **kw)[0], model, config)


def make_plan(config: str, world: int, degrees: dict, *, global_batch: int, seq_len: int, sequence_parallel=False,
              cp_method=None, pp_schedule=None, microbatches=None):
    """The plan of one layout for the model of ``config`` (``hyper_parallel.auto.evaluate_plan``)."""
    from hyper_parallel.auto import Cluster, evaluate_plan
    kw = dict(degrees=degrees, global_batch=global_batch, seq_len=seq_len, sequence_parallel=sequence_parallel,
              cp_method=cp_method, pp_schedule=pp_schedule, microbatches=microbatches)
    cluster = Cluster(world, world, "1GiB")
    return _plan_hf(lambda m, **extra: evaluate_plan(m, cluster, **kw, **extra),
                    build_model(config, 0, torch.float32), config)


__all__ = ["train_reference", "train_parallel", "logits_of", "make_plan", "choose_plan", "moe_roles"]
