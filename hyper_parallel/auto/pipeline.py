"""``Plan.apply`` of pipeline plans: split the model into stages, lay out each stage as a whole model
(``parallelize.parallelize_part``: TP/SP, CP, AC, EP, FSDP), and return torch's schedule.

Every stage is built in torch's **static** mode: its boundary shapes are given (``input_args`` /
``output_args``), so no metadata travels between the stages, which is also what lets ``dry_run`` run
one stage of a pipeline on the fake process group (it moves no data). The boundaries follow from the
layout: stage inputs and outputs are the hidden state ``[microbatch, S_local, dim]`` between blocks
(``S_local = seq_len / cp``; with sequence parallelism a ``Shard(1)`` DTensor over tp whose local shard is
this rank's ``torch.chunk`` of it), the first stage takes the token ids ``[microbatch, seq_len / cp]`` and the last returns
the logits ``[microbatch, seq_len / cp, vocab]`` (replicated over tp).
"""
from __future__ import annotations

import torch

from hyper_parallel.auto.parallelize import PP_SCHEDULES, ce_loss, parallelize_part


def _chunk_len(length, chunks, index):
    parts = torch.arange(length).chunk(chunks)
    return len(parts[index]) if index < len(parts) else 0


def boundary_args(plan, info, model, rank_coords, tp_mesh=None):
    """(first stage's inputs, hidden state, last stage's outputs) as meta tensors with this rank's local
    shapes (``rank_coords``: this rank's mesh coordinates, ``Plan.coordinates``)."""
    d = plan.degrees
    b_local = plan.global_batch // (d["dp"] * d["fsdp"])
    mb = b_local // plan.microbatches
    s_loc = plan.seq_len // d["cp"]
    s_hid = _chunk_len(s_loc, d["tp"], rank_coords.get("tp", 0)) if plan.sequence_parallel else s_loc
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    tokens = torch.empty(mb, s_loc, dtype=torch.long, device="meta")
    hidden = torch.empty(mb, s_hid, info.dim, dtype=dtype, device="meta", requires_grad=True)
    if plan.sequence_parallel and tp_mesh is not None:  # the SP boundary: a Shard(1) DTensor over tp
        from hyper_parallel import DTensor, Shard
        hidden = DTensor.from_local(hidden, tp_mesh, [Shard(1)], shape=(mb, s_loc, info.dim),
                                    stride=(s_loc * info.dim, info.dim, 1))
    logits = torch.empty(mb, s_loc, info.vocab, dtype=dtype, device="meta", requires_grad=True)
    return tokens, hidden, logits


def apply_pipeline(plan, model, info, mesh, *, loss_fn=None, stage_cls=None):
    """This rank's stages (``hyper_parallel.pipelining.split_into_stages``, names kept), each laid out by
    ``parallelize_part``, in torch's schedule. Returns the schedule (``step(x, target=y, losses=[])``); its
    ``stage_modules`` hold this rank's modules (for the optimizer), ``pp_group`` the pipeline mesh (for
    ``hyper_parallel.pipelining.clip_grad_norm_``), ``has_first`` / ``has_last`` say what it feeds."""
    from hyper_parallel import pipelining as pp
    from hyper_parallel.auto.hf_adapt import is_hf_model
    if ("." in info.blocks_path or not info.blocks_path) and not is_hf_model(model):
        raise NotImplementedError(f"Plan.apply: pipelining needs the blocks as a ModuleDict attribute of the model "
                                  f"root (or a Hugging Face decoder LM), found them at {info.blocks_path!r}")
    inputs = tuple(n for n, r in info.module_roles.items() if r == "embedding" and "." not in n)
    outputs = tuple(n for n, c in model.named_children()
                    if n not in inputs and n != info.blocks_path and any(True for _ in c.parameters()))
    name = PP_SCHEDULES[plan.pp_schedule]
    n_stages = len(plan.layers_per_stage)
    tokens, hidden, logits = boundary_args(plan, info, model, plan.coordinates(torch.distributed.get_rank()),
                                           mesh["tp"] if plan.degrees["tp"] > 1 else None)
    if is_hf_model(model):  # Hugging Face: stages that run the decoder loop, names kept (hf_pipeline)
        from hyper_parallel.auto.hf_pipeline import split_hf_stages
        pp = split_hf_stages(pp, info.blocks_path)
    parts = pp.split_into_stages(model, mesh["pp"], num_stages=n_stages, schedule=name, layers=info.blocks_path,
                                 input_modules=inputs, output_modules=outputs,
                                 stage_layers=list(plan.layers_per_stage))  # the split the planner costed
    for _, m in parts:
        parallelize_part(plan, m, info, mesh)
    dev = torch.device(mesh.device_type)
    cls = stage_cls or pp.PipelineStage
    stages = [cls(m, s, n_stages, dev, input_args=tokens if s == 0 else hidden,
                  output_args=logits if s == n_stages - 1 else hidden, group=mesh["pp"].get_group())
              for s, m in parts]
    single = n_stages == plan.degrees["pp"]
    schedule = pp.get_schedule_class(name)(stages[0] if single else stages, n_microbatches=plan.microbatches,
                                           loss_fn=loss_fn or ce_loss)
    schedule.stage_modules = [m for _, m in parts]
    schedule.pp_group = mesh["pp"]
    schedule.has_first = any(s == 0 for s, _ in parts)
    schedule.has_last = any(s == n_stages - 1 for s, _ in parts)
    return schedule
