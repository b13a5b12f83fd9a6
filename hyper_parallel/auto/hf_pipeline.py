"""Pipeline stages of a Hugging Face decoder LM (blocks at ``model.layers``), parameter names kept.

torch's pipeline runs each stage as ``stage(x)``: hidden state in, hidden state (or logits) out. A HF
``*ForCausalLM`` cannot run a part of itself (its base model needs ``input_ids`` and runs every layer), so a
stage here is a small module holding the same children under the same names (``model.embed_tokens`` on the
first stage, ``model.layers.<i>`` for its blocks in a ``ModuleDict`` keyed by the block's index,
``model.norm`` and ``lm_head`` on the last, ``model.rotary_emb`` on all), whose forward is the decoder's
own loop: embed, rotary cos/sin of the positions ``0 .. L-1`` (mapped to each rank's positions under context
parallelism by ``hf_adapt``), every block ``layer(h, attention_mask=None, position_embeddings=..., position_ids=...)``,
norm, head.

That loop is the base model's forward only for the decoder families in ``PIPELINE_MODEL_TYPES`` with full
causal attention everywhere (no sliding window, no per-layer attention types, no scaled embeddings):
anything else raises at ``apply`` rather than train another function.
"""
from __future__ import annotations

import copy
from typing import Any, List, Tuple

import torch
import torch.nn as nn

PIPELINE_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def _fail(msg):
    raise NotImplementedError(f"Plan.apply: pipelining this Hugging Face model: {msg}; use a plan without pp")


def check_pipeline_model(model: nn.Module, blocks_path: str) -> str:
    """The base model's path (the parent of the blocks), after checking that the stage loop is its forward."""
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in PIPELINE_MODEL_TYPES:
        _fail(f"model_type {mt!r} is not one whose decoder loop the stages reproduce ({', '.join(PIPELINE_MODEL_TYPES)})")
    if getattr(cfg, "use_sliding_window", True) and getattr(cfg, "sliding_window", None):
        _fail(f"sliding_window={cfg.sliding_window} needs the model's attention mask, which the stages do not build")
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        _fail(f"layer_types {sorted(set(cfg.layer_types))} need per-layer attention masks")
    base_path, _, leaf = blocks_path.rpartition(".")
    if leaf != "layers" or not base_path or "." in base_path:
        _fail(f"the blocks are at {blocks_path!r}, expected '<base>.layers' (e.g. 'model.layers')")
    base = model.get_submodule(base_path)
    for need in ("embed_tokens", "norm", "rotary_emb"):
        if getattr(base, need, None) is None:
            _fail(f"{base_path}.{need} is missing")
    head = getattr(model, "lm_head", None)
    if head is None:
        _fail("the model has no lm_head")
    if head.weight is base.embed_tokens.weight:
        _fail("the output head is tied to the token embedding (tie_word_embeddings=True), and the two live on "
              "different stages; untie them (tie_word_embeddings=False)")
    for name, child in model.named_children():
        if name not in (base_path, "lm_head") and any(True for _ in child.parameters()):
            _fail(f"the child {name!r} holds parameters the stages do not place")
    return base_path


class HFStage(nn.Module):
    """One stage: the HF model's children it owns, under their unsplit names (see the module docstring)."""

    def __init__(self, model: nn.Module, base_path: str, block_keys: List[str], first: bool, last: bool):
        super().__init__()
        base = model.get_submodule(base_path)
        layers = base.layers
        base.layers = nn.ModuleDict()
        try:
            stage_base = copy.deepcopy(base)   # everything but the blocks
        finally:
            base.layers = layers
        by_key = dict(layers.named_children())
        stage_base.layers = nn.ModuleDict({k: copy.deepcopy(by_key[k]) for k in block_keys})
        if not first:
            stage_base.embed_tokens = None
        if not last:
            stage_base.norm = None
        setattr(self, base_path, stage_base)
        self.lm_head = copy.deepcopy(model.lm_head) if last else None
        self.base_path = base_path
        self.config = model.config

    def forward(self, inputs):
        base = getattr(self, self.base_path)
        if base.embed_tokens is not None:
            n = inputs.shape[1]               # token ids [microbatch, seq]
            h = base.embed_tokens(inputs)
        else:
            h, n = inputs, inputs.shape[1]    # hidden state (a Shard(1) DTensor with sp: its global length)
        position_ids = torch.arange(n, device=h.device).unsqueeze(0)
        position_embeddings = base.rotary_emb(h, position_ids=position_ids)
        for layer in base.layers.values():
            h = layer(h, attention_mask=None, position_embeddings=position_embeddings, position_ids=position_ids)
            if isinstance(h, tuple):
                h = h[0]
        if base.norm is not None:
            h = base.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h


class HFPipelining:
    """``hyper_parallel.pipelining`` with ``split_into_stages`` splitting a HF model into :class:`HFStage` s (same
    arguments; the input / output module names are HF's own and ignored); everything else is the package's."""

    def __init__(self, pipelining, blocks_path: str):
        self._pp, self._blocks_path = pipelining, blocks_path

    def __getattr__(self, name):
        return getattr(self._pp, name)

    def split_into_stages(self, model, pp_mesh, num_stages=None, layers_per_stage=None, schedule="1F1B", *,
                          layers=None, input_modules=(), output_modules=(), stage_layers=None
                          ) -> List[Tuple[int, nn.Module]]:
        """This rank's ``(stage index, HFStage)`` pairs, on the stage map of the package's ``split_into_stages``
        (``stage_layers``: every stage's block count)."""
        from hyper_parallel.pipelining.schedules import schedule_kind
        from hyper_parallel.pipelining.split import plan_stages, stage_ids_on_rank
        base_path = check_pipeline_model(model, self._blocks_path)
        keys = [k for k, _ in model.get_submodule(self._blocks_path).named_children()]
        if stage_layers is not None:
            if sum(stage_layers) != len(keys) or min(stage_layers) < 0:
                raise ValueError(f"split_into_stages: stage_layers={list(stage_layers)} must be block counts summing "
                                 f"to the model's {len(keys)} blocks")
            starts = [sum(stage_layers[:i]) for i in range(len(stage_layers))]
            plan = [keys[a:a + n] for a, n in zip(starts, stage_layers)]
        else:
            plan = plan_stages(keys, num_stages, layers_per_stage, input_weight=1, output_weight=1)
        style, _ = schedule_kind(schedule)
        mine = stage_ids_on_rank(pp_mesh.get_local_rank(), pp_mesh.size(), len(plan), style)
        return [(s, HFStage(model, base_path, plan[s], s == 0, s == len(plan) - 1)) for s in mine]


def split_hf_stages(pipelining: Any, blocks_path: str) -> HFPipelining:
    """The pipelining package as ``Plan.apply`` uses it, splitting HF models (see :class:`HFPipelining`)."""
    return HFPipelining(pipelining, blocks_path)


__all__ = ["PIPELINE_MODEL_TYPES", "check_pipeline_model", "HFStage", "HFPipelining", "split_hf_stages"]
