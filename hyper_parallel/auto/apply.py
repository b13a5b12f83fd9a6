"""``Plan.apply(model)``: build the plan's mesh and parallelize a model with the library's own styles.

``hyper_parallel.auto.parallelize.parallelize_part`` lays out one module (the whole model, or one pipeline stage: a copy of the
model with the parts other stages own deleted, names kept), in torchtitan's order:

1. **TP (+SP)**, per block, from the roles: attention q/k/v and MLP gate/up ``ColwiseParallel``,
   attention o and MLP down ``RowwiseParallel`` (output ``Shard(1)`` with sequence parallelism, else
   ``Replicate()``), the attention / MLP modules get a ``PrepareModuleInput`` that gathers the sequence,
   norms ``SequenceParallel`` (with SP); the embedding ``RowwiseParallel``, the head ``ColwiseParallel``
   (replicated logits). The hidden state between modules stays a plain local tensor (``[B, S/tp, D]``
   with SP); at a pipeline stage boundary with SP it is a ``Shard(1)`` DTensor (the stage's forward
   reads the global sequence length from it).
2. **CP**: ``ContextParallel(cp_method)`` on every attention module over ``mesh["cp"]``, and the
   model's positional tables (root buffers with ``>= seq_len`` rows, e.g. rotary cos/sin) cut to this
   rank's load-balanced positions; :meth:`Plan.shard_batch` cuts each batch the same way.
3. **Activation checkpointing**: "full" wraps each block's forward in ``torch.utils.checkpoint``;
   "selective" does so with an op-level policy (``hyper_parallel.auto.selective_ac``).
4. **EP**: grouped experts ``ExpertParallel`` over ``ep`` and ``fully_shard`` over ``efsdp``.
5. **Data parallelism**: ``fully_shard`` per block and on the root over ``fsdp`` (HSDP over
   ``("dp", "fsdp")``; over the flattened ``(fsdp, cp)`` dims with cp, and over ``cp`` alone in a
   pipeline without fsdp), or ``replicate`` over ``dp`` (flattened ``(dp, cp)``).

Pipelines: ``hyper_parallel.auto.pipeline`` splits the model, applies ``parallelize_part`` to every
stage of this rank and returns torch's schedule. This module is the entry (``apply_plan``) and imports
both; they import ``parallelize`` only, so the imports stay acyclic.
"""
from __future__ import annotations

import torch.nn as nn

import hyper_parallel as hp
from hyper_parallel.auto.model_stats import trace_model
from hyper_parallel.auto.parallelize import parallelize_part
from hyper_parallel.auto.pipeline import apply_pipeline
from hyper_parallel.auto.roles import infer_roles


def build_mesh(plan, device_type="cpu"):
    return hp.init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)


def model_info(plan, model, roles=None):
    info = plan._model_info
    if info is None or roles is not None:
        info = infer_roles(model, trace_model(model, plan.seq_len), roles)
    return info


def apply_plan(plan, model: nn.Module, *, roles=None, device_type="cpu", mesh=None, loss_fn=None, stage_cls=None):
    if plan.activation_checkpointing not in ("none", "full", "selective"):
        raise ValueError(f"Plan.apply: activation_checkpointing={plan.activation_checkpointing!r}; expected 'none', "
                         "'full' or 'selective'")
    info = model_info(plan, model, roles)
    for k in ("_flat_meshes", "_dense_mesh", "_cp_mesh"):  # meshes of an earlier apply (another world)
        plan.__dict__.pop(k, None)
    mesh = mesh if mesh is not None else build_mesh(plan, device_type)
    plan.__dict__["_mesh"] = mesh
    if plan.degrees["pp"] > 1:
        return apply_pipeline(plan, model, info, mesh, loss_fn=loss_fn, stage_cls=stage_cls)
    parallelize_part(plan, model, info, mesh)
    return model
