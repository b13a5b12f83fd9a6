"""``Plan.apply(model)``: build the plan's mesh and parallelize a model with the library's own styles.

Per block (the children of the model's largest ModuleList/ModuleDict), from the roles:
attention q/k/v and MLP gate/up ``ColwiseParallel``, attention o and MLP down ``RowwiseParallel``
(output ``Shard(1)`` with sequence parallelism, else ``Replicate()``), the attention / MLP modules get
a ``PrepareModuleInput`` that gathers the sequence, norms ``SequenceParallel`` (with SP); the
embedding ``RowwiseParallel``, the head ``ColwiseParallel`` (replicated logits). Activation
checkpointing "full" wraps each block's forward in ``torch.utils.checkpoint`` (non-reentrant).
Then ``fully_shard`` per block and on the root over ``fsdp`` (HSDP over ``("dp", "fsdp")``), or
``replicate`` over ``dp``. Grouped experts: ``ExpertParallel`` over ``ep`` and ``fully_shard`` over
the remaining ``efsdp`` ranks (their gradients averaged over every data-parallel rank).
Pipelines (with fsdp): ``hyper_parallel.pipelining.split_into_stages`` (names kept), FSDP per stage,
torch's schedule returned. Context parallelism needs the training loop to shard the sequence: ``apply``
raises for it and names what to use instead (docs/auto_parallel.md "Limits").
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import hyper_parallel as hp
from hyper_parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, Replicate,
                            RowwiseParallel, SequenceParallel, Shard, parallelize_module)
from hyper_parallel.auto.model_stats import trace_model
from hyper_parallel.auto.roles import infer_roles


def build_mesh(plan, device_type="cpu"):
    return hp.init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)


def _rel(prefix, fqn):
    return fqn[len(prefix) + 1:] if prefix and fqn.startswith(prefix + ".") else fqn


def apply_plan(plan, model: nn.Module, *, roles=None, device_type="cpu", mesh=None, loss_fn=None):
    d = plan.degrees
    if d["pp"] > 1:
        return _apply_pipeline(plan, model, roles=roles, device_type=device_type, mesh=mesh, loss_fn=loss_fn)
    if d["cp"] > 1:
        raise NotImplementedError(
            f"Plan.apply: context-parallel plans (cp={d['cp']}) need the training loop to shard the sequence; run "
            f"them with examples/llama/train.py {' '.join(plan.to_args())} or hyper_parallel.context_parallel")
    info = plan._model_info
    if info is None or roles is not None:
        info = infer_roles(model, trace_model(model, plan.seq_len), roles)
    mesh = mesh if mesh is not None else build_mesh(plan, device_type)
    names = mesh.mesh_dim_names
    tp, sp = d["tp"], plan.sequence_parallel
    seq = Shard(1) if sp else Replicate()
    mods = dict(model.named_modules())
    roles_of = info.module_roles
    ep = d["ep"]
    dense = None
    if ep > 1:  # dense parts on a ("fsdp", "tp") root over the same ranks (fully_shard needs TP's root mesh)
        dense = hp.init_device_mesh(mesh.device_type, (d["fsdp"], tp), mesh_dim_names=("fsdp", "tp"))
    if tp > 1:
        tp_mesh = (dense if dense is not None else mesh)["tp"]
        for n in info.norm_modules:
            SequenceParallel.register_module_type(type(mods[n]))
        in_block = lambda f: any(f == b or f.startswith(b + ".") for b in info.block_names)
        top = {}
        for f, r in roles_of.items():
            if in_block(f):
                continue
            if r == "embedding":
                top[f] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
            elif r == "output":
                top[f] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
            elif r == "norm" and sp:
                top[f] = SequenceParallel()
        if top:
            parallelize_module(model, tp_mesh, top, src_data_rank=None)
        n_args = {}
        for b, is_moe in zip(info.block_names, info.block_is_moe):
            bp = {}
            for a in info.attention_modules:
                if a.startswith(b + "."):
                    k = max(plan_args(info, a, model), 1)
                    bp[_rel(b, a)] = PrepareModuleInput(input_layouts=(seq,) + (None,) * (k - 1),
                                                        desired_input_layouts=(Replicate(),) + (None,) * (k - 1),
                                                        use_local_output=True)
            moes = [m for m in info.moe_modules if m.startswith(b + ".")]
            for mlp in info.mlp_modules:
                if mlp.startswith(b + ".") and not any(mlp.startswith(m + ".") for m in moes):
                    bp[_rel(b, mlp)] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                          use_local_output=True)
            for m in moes:
                if sp:
                    bp[_rel(b, m)] = PrepareModuleInputOutput(
                        input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
                        output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
            for f, r in roles_of.items():
                if not f.startswith(b + "."):
                    continue
                shared = any(f.startswith(m + ".") for m in moes)
                if r in ("attention_q", "attention_k", "attention_v", "mlp_gate", "mlp_up"):
                    bp[_rel(b, f)] = ColwiseParallel()
                elif r in ("attention_o", "mlp_down"):
                    bp[_rel(b, f)] = RowwiseParallel(output_layouts=Replicate() if shared else seq)
                elif r == "norm" and sp:
                    bp[_rel(b, f)] = SequenceParallel()
            parallelize_module(mods[b], tp_mesh, bp, src_data_rank=None)
    if plan.activation_checkpointing == "full":
        for b in info.block_names:
            blk = mods[b]
            blk.forward = functools.partial(checkpoint, blk.forward, use_reentrant=False)
    elif plan.activation_checkpointing not in ("none",):
        raise NotImplementedError(f"Plan.apply: activation_checkpointing={plan.activation_checkpointing!r} is not "
                                  "applied yet (only 'none' and 'full')")
    if ep > 1:
        from hyper_parallel.moe import ExpertParallel
        for f, r in roles_of.items():
            if r == "experts":
                parallelize_module(mods[f], mesh["ep"], ExpertParallel(), src_data_rank=None)
                hp.fully_shard(mods[f], mesh=mesh["efsdp"])
                # each ep rank's expert gradients sum over every data-parallel rank's tokens: average over all
                mods[f].set_gradient_divide_factor(d["fsdp"])
        for b in info.block_names:
            hp.fully_shard(mods[b], mesh=dense["fsdp"])
        hp.fully_shard(model, mesh=dense["fsdp"])
        return model
    if d["fsdp"] > 1:
        fs_mesh = mesh["dp", "fsdp"] if d["dp"] > 1 else mesh["fsdp"]
        for b in info.block_names:
            hp.fully_shard(mods[b], mesh=fs_mesh)
        hp.fully_shard(model, mesh=fs_mesh)
    elif d["dp"] > 1:
        hp.replicate(model, mesh["dp"])
    return model


def plan_args(info, module_fqn, model):
    """Positional arguments the module's forward took in the trace (attention takes (x, cos, sin) ...)."""
    return info.n_args.get(module_fqn, 1)


PP_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B"}


def _ce_loss(out, target):
    out = out.full_tensor() if isinstance(out, hp.DTensor) else out
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))


def _apply_pipeline(plan, model, *, roles, device_type, mesh, loss_fn):
    """pp (x fsdp): this rank's stages (``hyper_parallel.pipelining.split_into_stages``, names kept), each
    ``fully_shard``-ed per block and on the stage root over ``fsdp``, in torch's schedule. Returns the
    schedule (``step(x, target=y, losses=[])``); its ``stage_modules`` hold this rank's modules (for the
    optimizer) and ``pp_group`` the pipeline group (for ``hyper_parallel.pipelining.clip_grad_norm_``)."""
    from hyper_parallel import pipelining as pp
    d = plan.degrees
    if d["tp"] > 1 or d["cp"] > 1 or d["ep"] > 1 or plan.activation_checkpointing != "none":
        raise NotImplementedError(
            f"Plan.apply: pipeline plans are applied with fsdp only (got {plan.summary()}); run this one with "
            f"examples/llama/train.py {' '.join(plan.to_args())}")
    info = plan._model_info
    if info is None or roles is not None:
        info = infer_roles(model, trace_model(model, plan.seq_len), roles)
    if "." in info.blocks_path or not info.blocks_path:
        raise NotImplementedError(f"Plan.apply: pipelining needs the blocks as a ModuleDict attribute of the model "
                                  f"root, found them at {info.blocks_path!r}")
    mesh = mesh if mesh is not None else build_mesh(plan, device_type)
    inputs = tuple(n for n, r in info.module_roles.items() if r == "embedding" and "." not in n)
    outputs = tuple(n for n, c in model.named_children()
                    if n not in inputs and n != info.blocks_path and any(True for _ in c.parameters()))
    name = PP_SCHEDULES[plan.pp_schedule]
    n_stages = len(plan.layers_per_stage)
    parts = pp.split_into_stages(model, mesh["pp"], num_stages=n_stages, schedule=name, layers=info.blocks_path,
                                 input_modules=inputs, output_modules=outputs)
    if d["fsdp"] > 1:
        for _, m in parts:
            for block in getattr(m, info.blocks_path).values():
                hp.fully_shard(block, mesh=mesh["fsdp"])
            hp.fully_shard(m, mesh=mesh["fsdp"])
    dev = torch.device(device_type)
    stages = [pp.PipelineStage(m, s, n_stages, dev, group=mesh["pp"].get_group()) for s, m in parts]
    cls = pp.get_schedule_class(name)
    single = n_stages == d["pp"]
    schedule = cls(stages[0] if single else stages, n_microbatches=plan.microbatches, loss_fn=loss_fn or _ce_loss)
    schedule.stage_modules = [m for _, m in parts]
    schedule.pp_group = mesh["pp"]
    schedule.has_first = any(s == 0 for s, _ in parts)
    schedule.has_last = any(s == n_stages - 1 for s, _ in parts)
    return schedule
