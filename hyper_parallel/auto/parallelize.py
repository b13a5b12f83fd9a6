"""One module laid out by a plan: ``parallelize_part`` (TP/SP, CP, AC, EP, FSDP/replicate in torchtitan's
order; see ``hyper_parallel.auto.apply``), used for the whole model and for each pipeline stage."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import hyper_parallel as hp
from hyper_parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, Replicate,
                            RowwiseParallel, SequenceParallel, Shard, parallelize_module)


def _rel(prefix, fqn):
    return fqn[len(prefix) + 1:] if prefix and fqn.startswith(prefix + ".") else fqn


def _flat(plan, mesh, dims):
    """``mesh[dims]`` flattened into one dim (collective; built once per ``apply``)."""
    if len(dims) == 1:
        return mesh[dims[0]]
    cache = plan.__dict__.setdefault("_flat_meshes", {})
    name = "_".join(dims)
    if name not in cache:
        cache[name] = mesh[dims]._flatten(name)
    return cache[name]


def _dense_mesh(plan, mesh):
    """With ep: a root mesh over the same ranks whose "fsdp" dim spans efsdp x ep (the dense parts are fully
    sharded over all of them; fully_shard needs TP's root mesh), built once per ``apply``."""
    d = plan.degrees
    if "_dense_mesh" not in plan.__dict__:
        shape, names = (d["fsdp"], d["tp"]), ("fsdp", "tp")
        if d["pp"] > 1:
            shape, names = (d["pp"],) + shape, ("pp",) + names
        plan.__dict__["_dense_mesh"] = hp.init_device_mesh(mesh.device_type, shape, mesh_dim_names=names)
    return plan.__dict__["_dense_mesh"]


def parallelize_part(plan, model: nn.Module, info, mesh):
    """Apply the plan's TP/SP, CP, AC, EP and FSDP/replicate to ``model`` in place (the whole model, or a
    pipeline stage holding a subset of the blocks and top-level modules under their unsplit names)."""
    d = plan.degrees
    tp, sp, ep, cp = d["tp"], plan.sequence_parallel, d["ep"], d["cp"]
    seq = Shard(1) if sp else Replicate()
    mods = dict(model.named_modules())
    blocks = [(b, moe) for b, moe in zip(info.block_names, info.block_is_moe) if b in mods]
    roles_of = {f: r for f, r in info.module_roles.items() if f in mods}
    dense = _dense_mesh(plan, mesh) if ep > 1 else None
    if tp > 1:
        _refuse_unsharded_roles(roles_of)
        tp_mesh = (dense if dense is not None else mesh)["tp"]
        for n in info.norm_modules:
            if n in mods:
                SequenceParallel.register_module_type(type(mods[n]))
        in_block = lambda fqn: any(fqn == b or fqn.startswith(b + ".") for b in info.block_names)
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
        for b, _ in blocks:
            bp = {}
            for a in info.attention_modules:
                if a.startswith(b + "."):
                    bp[_rel(b, a)] = _attention_input(mods[a], info.n_args.get(a, 1), seq)
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
                elif r == "norm" and _in_attention(f, info, mods):  # per-head norm (Qwen3's q_norm): heads sharded
                    bp[_rel(b, f)] = SequenceParallel(sequence_dim=-2, use_local_output=True)
                elif r == "norm" and sp:
                    bp[_rel(b, f)] = SequenceParallel()
            parallelize_module(mods[b], tp_mesh, bp, src_data_rank=None)
        if sp and blocks:
            _sp_stage_boundaries(model, info, mods, roles_of, blocks, tp_mesh, seq)
    if cp > 1:
        _apply_cp(plan, model, info, mesh, mods)
    if cp > 1 or (tp > 1 and sp):  # rotary tables of the attention's positions (hf_adapt)
        from hyper_parallel.auto.hf_adapt import install_positions
        install_positions(model, [f for f, r in roles_of.items() if r == "embedding"],
                          cp_mesh=mesh["cp"] if cp > 1 else None, sequence_parallel=tp > 1 and sp)
    if plan.activation_checkpointing == "full":
        k = getattr(plan, "recompute_layers", None)
        for b, _ in (blocks if k is None else blocks[:k]):  # Megatron's block method: the stage's first k
            blk = mods[b]
            blk.forward = functools.partial(checkpoint, blk.forward, use_reentrant=False)
    elif plan.activation_checkpointing == "selective":
        from hyper_parallel.auto.selective_ac import checkpoint_selective
        for b, _ in blocks:
            checkpoint_selective(mods[b])
    # in a pipeline every microbatch would gather the parameters again: keep them gathered from the first
    # forward to the last backward of the step, as torchtitan does (reshard_after_forward=False with pp)
    keep = False if d["pp"] > 1 else None
    if ep > 1:
        from hyper_parallel.auto.hf_experts import AnyExpertParallel as ExpertParallel  # also HF's experts modules
        for f, r in roles_of.items():
            if r == "experts":
                parallelize_module(mods[f], mesh["ep"], ExpertParallel(), src_data_rank=None)
                hp.fully_shard(mods[f], mesh=mesh["efsdp"], reshard_after_forward=keep)
                # each ep rank's expert gradients sum over every data-parallel rank's tokens: average over all
                mods[f].set_gradient_divide_factor(d["fsdp"])
        for b, _ in blocks:
            hp.fully_shard(mods[b], mesh=dense["fsdp"], reshard_after_forward=keep)
        hp.fully_shard(model, mesh=dense["fsdp"], reshard_after_forward=keep)
        return model
    fs = None
    if d["fsdp"] > 1:
        fs = ("dp", "fsdp") if d["dp"] > 1 else ("fsdp", "cp") if cp > 1 else ("fsdp",)
    elif d["pp"] > 1 and cp > 1:  # the gradients reduce over cp by FSDP over cp (HSDP with dp replicas)
        fs = ("dp", "cp") if d["dp"] > 1 else ("cp",)
    if fs is not None:
        fs_mesh = mesh[fs] if fs in (("dp", "fsdp"), ("dp", "cp")) else _flat(plan, mesh, fs)
        for b, _ in blocks:
            hp.fully_shard(mods[b], mesh=fs_mesh, reshard_after_forward=keep)
        hp.fully_shard(model, mesh=fs_mesh, reshard_after_forward=keep)
    elif d["dp"] > 1 or cp > 1:
        hp.replicate(model, _flat(plan, mesh, tuple(k for k in ("dp", "cp") if d[k] > 1)))
    return model


# Roles the planner recognises and costs but Plan.apply does not shard over tp yet: a fused q/k/v or gate/up
# projection (its output is split by the model's code at global sizes, so its columns cannot simply be cut)
# and MLA's key/value up-projection (untested under tp). Left replicated, the model would fail with a shape
# error or, worse, mix sharded and whole heads: refuse them by name instead.
_NOT_SHARDED_BY_APPLY = {"attention_qkv": "a fused q/k/v projection", "mlp_gate_up": "a fused gate/up projection",
                         "attention_kv": "MLA's key/value up-projection (kv_b_proj)"}


def _refuse_unsharded_roles(roles_of):
    found = {f: r for f, r in roles_of.items() if r in _NOT_SHARDED_BY_APPLY}
    if found:
        named = ", ".join(f"{f!r} ({_NOT_SHARDED_BY_APPLY[r]}, role {r!r})" for f, r in sorted(found.items()))
        raise NotImplementedError(
            f"Plan.apply: tensor parallelism cannot yet shard {named}. Choose a plan without tp: "
            "plan(model, cluster, ..., parallelisms=('dp', 'fsdp', 'pp', 'cp', 'ep')), or split the fused "
            "projection into separate Linear modules")


def _attention_input(module, n_args, seq):
    """The attention module's input gathered over tp: its first positional input, or, for keyword-only calls
    (Hugging Face: ``self_attn(hidden_states=...)``), the keyword of its forward's first parameter."""
    if n_args == 0:
        from hyper_parallel.auto.hf_adapt import first_input_name
        name = first_input_name(module)
        if name is not None:
            return PrepareModuleInput(input_kwarg_layouts={name: seq}, desired_input_kwarg_layouts={name: Replicate()},
                                      use_local_output=True)
    k = max(n_args, 1)
    return PrepareModuleInput(input_layouts=(seq,) + (None,) * (k - 1),
                              desired_input_layouts=(Replicate(),) + (None,) * (k - 1), use_local_output=True)


def _in_attention(fqn, info, mods):
    """A per-head norm inside attention (Qwen3's q_norm / k_norm: weight of head_dim entries, on head-sharded
    tensors under tp); the planner's ``head_norms`` when it lists them."""
    listed = getattr(info, "head_norms", None)
    if listed is not None:
        return fqn in listed
    weight = getattr(mods.get(fqn), "weight", None)
    return (any(fqn.startswith(a + ".") for a in info.attention_modules) and weight is not None
            and weight.numel() == info.head_dim)


def _sp_stage_boundaries(model, info, mods, roles_of, blocks, tp_mesh, seq):
    """A pipeline stage with SP: the hidden state crossing a stage boundary is a ``Shard(1)`` DTensor (the
    stage sends its local shard and the layout; the next stage rebuilds it), so that a stage's forward sees
    the global sequence length (it sizes the rotary tables from it). No-op for a whole model."""
    from hyper_parallel import PrepareModuleOutput
    first, last = blocks[0][0], blocks[-1][0]
    if "embedding" not in roles_of.values():
        k = max(info.n_args.get(first, 1), 1)
        parallelize_module(mods[first], tp_mesh, PrepareModuleInput(
            input_layouts=(seq,) + (None,) * (k - 1), desired_input_layouts=(seq,) + (None,) * (k - 1),
            use_local_output=True))
    if "output" not in roles_of.values():
        parallelize_module(mods[last], tp_mesh, PrepareModuleOutput(output_layouts=seq, desired_output_layouts=seq,
                                                                     use_local_output=False))


def positional_buffers(model, seq_len):
    """Names of the root module's own buffers with at least ``seq_len`` rows (per-position tables, such as
    rotary cos/sin, that the model slices to the sequence length it sees)."""
    return [n for n, b in model._buffers.items() if b is not None and b.dim() >= 1 and b.shape[0] >= seq_len]


def _apply_cp(plan, model, info, mesh, mods):
    from hyper_parallel.auto.hf_adapt import check_context_parallel
    from hyper_parallel.context_parallel import ContextParallel, cp_shard
    check_context_parallel(model, [f for f, r in info.module_roles.items() if r == "embedding"])
    cp_mesh = mesh["cp"]
    style = {}
    for a in info.attention_modules:
        if a in mods:
            style[a] = ContextParallel(method=plan.cp_method or "ring", load_balance=True)
    if style:
        parallelize_module(model, cp_mesh, style)
    S = plan.seq_len
    for n in positional_buffers(model, S):
        (local,) = cp_shard(cp_mesh, [model._buffers[n][:S]], [0], load_balance=True)
        model._buffers[n] = local.contiguous()
    plan.__dict__["_cp_mesh"] = cp_mesh


PP_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B"}


def ce_loss(out, target):
    from hyper_parallel.auto.hf_adapt import output_logits
    out = output_logits(out)  # HF's CausalLMOutputWithPast: its logits
    out = out.full_tensor() if isinstance(out, hp.DTensor) else out
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))
