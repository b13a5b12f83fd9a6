"""What ``Plan.apply`` does for Hugging Face models (or any model built the same way) beyond its generic layout.

* **Positions the model computes itself.** HF builds ``position_ids = arange(local length)`` inside the model
  and a rotary module (a buffer ``inv_freq``, ``forward(x, position_ids)``) turns them into cos/sin. Under
  context parallelism every rank would rotate by positions ``0 .. S/cp``; with sequence parallelism the
  tables would cover only the local ``S/tp`` rows. :func:`install_positions` hooks every rotary module so
  that it sees the positions of the sequence its attention computes: the rank's global positions under
  cp (the recorded order, :func:`hyper_parallel.context_parallel.positions.true_position_ids`), the whole
  (cp-local) sequence under sp (its length read from the token ids the embedding receives).
* **What it cannot place, it refuses at apply:** a rotary module whose forward takes no ``position_ids``,
  a learned absolute position embedding under cp, an attention implementation other than SDPA under cp.
* **Keyword-only calls.** HF calls attention as ``self_attn(hidden_states=..., ...)``: :func:`first_input_name`
  names the keyword that carries the hidden state, for ``PrepareModuleInput(input_kwarg_layouts=...)``.
"""
from __future__ import annotations

import inspect
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

POSITION_EMBEDDING_NAMES = ("wpe", "embed_positions", "position_embeddings", "position_embedding", "pos_emb")


def is_hf_model(model: nn.Module) -> bool:
    """A ``transformers`` model (duck-typed: a ``config`` with a ``model_type``; transformers is not imported)."""
    return hasattr(getattr(model, "config", None), "model_type")


def output_logits(out: Any) -> torch.Tensor:
    """The logits of a model's output: HF's ``ModelOutput`` (``.logits``), a tuple's first item, or the tensor."""
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (tuple, list)) else out


def first_input_name(module: nn.Module) -> Optional[str]:
    """The name of ``module.forward``'s first parameter (the hidden state of HF attention: ``hidden_states``)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    params = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return params[0].name if params else None


def rotary_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Modules holding an ``inv_freq`` buffer: HF's rotary embeddings (and others built the same way)."""
    return [(n, m) for n, m in model.named_modules() if "inv_freq" in m._buffers]


def _takes_position_ids(module: nn.Module) -> bool:
    try:
        return "position_ids" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _position_embeddings(model, token_embeddings):
    cfg = getattr(model, "config", None)
    max_pos = getattr(cfg, "max_position_embeddings", None)
    out = []
    for n, m in model.named_modules():
        if not isinstance(m, nn.Embedding) or n in token_embeddings:
            continue
        if n.rsplit(".", 1)[-1] in POSITION_EMBEDDING_NAMES or (max_pos and m.num_embeddings == max_pos):
            out.append(n)
    return out


def check_context_parallel(model: nn.Module, token_embeddings: Sequence[str]) -> None:
    """Raise (at apply) where context parallelism would compute with positions or attention it cannot place."""
    if is_hf_model(model):
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in (None, "sdpa"):
            raise NotImplementedError(
                f"Plan.apply: context parallelism intercepts F.scaled_dot_product_attention, but this "
                f"{type(model).__name__} computes attention with attn_implementation={impl!r}, which would see only "
                "this rank's sequence shard; load the model with attn_implementation='sdpa' "
                "(from_pretrained(..., attn_implementation='sdpa') or from_config(config, attn_implementation='sdpa'))")
    for n in _position_embeddings(model, token_embeddings):
        raise NotImplementedError(
            f"Plan.apply: {n!r} looks like a learned absolute position embedding; under context parallelism its "
            "positions are not placed on each rank's sequence shard (only rotary modules with forward(x, position_ids) "
            "and root position tables are). Use a plan without cp for this model")
    for n, m in rotary_modules(model):
        if not _takes_position_ids(m):
            raise NotImplementedError(
                f"Plan.apply: the rotary module {n!r} ({type(m).__name__}) takes no position_ids, so its positions "
                "cannot be placed on each rank's sequence shard under context parallelism; use a plan without cp")


class _SeqLen:
    """The length of the token sequence the model received in this forward (set by the embedding's hook)."""

    value: Optional[int] = None


def _replace_arg(args, kwargs, name, index, value):
    if name in kwargs:
        kwargs = dict(kwargs)
        kwargs[name] = value
        return args, kwargs
    args = list(args)
    args[index] = value
    return tuple(args), kwargs


def install_positions(model: nn.Module, token_embeddings: Sequence[str], *, cp_mesh: Any = None, sequence_parallel: bool = False) -> None:
    """Hook every rotary module of ``model`` to see the positions of its attention's sequence (see the module
    docstring). No-op without cp and sp or without rotary modules."""
    rotaries = [(n, m) for n, m in rotary_modules(model) if _takes_position_ids(m)]  # others: checked under cp
    if (cp_mesh is None and not sequence_parallel) or not rotaries:
        return
    seq = _SeqLen()
    if sequence_parallel:
        mods = dict(model.named_modules())
        embeds = [mods[n] for n in token_embeddings if n in mods]  # none on later pipeline stages

        def on_tokens(mod, args):
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
                seq.value = int(args[0].shape[1])

        def reset(mod, args, kwargs):
            seq.value = None

        model.register_forward_pre_hook(reset, with_kwargs=True)
        for e in embeds:
            e.register_forward_pre_hook(on_tokens)
    for name, rot in rotaries:
        rot.register_forward_pre_hook(_rotary_hook(name, cp_mesh, seq, sequence_parallel), with_kwargs=True)


def _rotary_hook(name, cp_mesh, seq, sequence_parallel):
    what = f"the rotary module {name!r}" + (" under context parallelism" if cp_mesh is not None else "")

    def pre(mod, args, kwargs):
        if "position_ids" in kwargs:
            ids = kwargs["position_ids"]
        elif len(args) >= 2:
            ids = args[1]
        else:
            raise TypeError(f"{what}: called without position_ids; expected forward(x, position_ids)")
        # the attention's sequence: the tokens the embedding received (sp: the rotary sees S/tp rows), else the
        # ids' own length (a pipeline stage passes the ids of its whole sequence)
        n = seq.value if sequence_parallel and seq.value is not None else ids.shape[-1]
        if cp_mesh is not None:
            from hyper_parallel.context_parallel.positions import true_position_ids
            new = true_position_ids(ids, cp_mesh, n, what)
        else:
            offset = ids[..., :1]
            if not torch.equal(ids, offset + torch.arange(ids.shape[-1], device=ids.device, dtype=ids.dtype)):
                raise ValueError(f"{what}: with sequence parallelism the position ids must be the model's default "
                                 f"(offset + arange), got {ids.reshape(-1)[:16].tolist()}")
            new = offset + torch.arange(n, device=ids.device, dtype=ids.dtype)
        return _replace_arg(args, kwargs, "position_ids", 1, new)

    return pre


__all__ = ["is_hf_model", "output_logits", "first_input_name", "rotary_modules", "check_context_parallel", "install_positions"]
