"""Tiny Hugging Face causal-LM configs built in code (no download), and the model / batch / loss of the example.

``build_config(name_or_path)`` takes a preset name (``llama-tiny``, ``qwen3-tiny``, ``qwen3-moe-tiny``), a local
directory holding a ``config.json`` (a config or a saved checkpoint), or a path to a ``config.json`` file.
``build_model`` makes the ``AutoModelForCausalLM`` from it (random weights from ``seed``, or the checkpoint's
weights when the directory holds them) with SDPA attention, the implementation context parallelism intercepts.
"""
from __future__ import annotations

import os
from typing import Callable, Dict

import torch


def _llama():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


def _qwen3():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
                          norm_topk_prob=True)


PRESETS: Dict[str, Callable] = {"llama-tiny": _llama, "qwen3-tiny": _qwen3, "qwen3-moe-tiny": _qwen3_moe}


def build_config(name_or_path: str):
    """A preset's config, or ``AutoConfig.from_pretrained`` of a local directory / ``config.json`` (no download)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]()
    if not os.path.exists(name_or_path):
        raise ValueError(f"config {name_or_path!r}: not a preset ({', '.join(PRESETS)}) nor a local path to a "
                         "config.json or a directory holding one")
    from transformers import AutoConfig
    path = os.path.dirname(name_or_path) if os.path.isfile(name_or_path) else name_or_path
    return AutoConfig.from_pretrained(path, local_files_only=True)


def has_weights(name_or_path: str) -> bool:
    return os.path.isdir(name_or_path) and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(name_or_path))


def _implementations(dtype):
    """SDPA attention (what context parallelism intercepts); the experts' plain loop where torch's grouped
    matmul has no kernel (float64 on CPU)."""
    out = {"attn_implementation": "sdpa"}
    if dtype == torch.float64:
        out["experts_implementation"] = "eager"
    return out


def build_model(name_or_path: str, seed: int = 0, dtype=torch.float64):
    """The causal LM of ``name_or_path`` (same weights on every rank: seeded init, or the checkpoint's)."""
    from transformers import AutoModelForCausalLM
    if has_weights(name_or_path):
        model = AutoModelForCausalLM.from_pretrained(name_or_path, local_files_only=True, dtype=dtype,
                                                     **_implementations(dtype))
    else:
        config = build_config(name_or_path)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **_implementations(dtype))
    return model.train()


def vocab_size(model) -> int:
    return model.config.get_text_config().vocab_size


def batch(seed: int, step: int, global_batch: int, seq_len: int, vocab: int):
    """Deterministic random token ids ``x`` and next-token targets ``y``, ``[global_batch, seq_len]``."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    t = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def logits_of(out):
    """The logits of a model output (HF ``ModelOutput``, a tuple, or a tensor)."""
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (tuple, list)) else out


def loss_fn(out, target):
    """Mean next-token cross-entropy over the rank's tokens (the training loss)."""
    logits = logits_of(out)
    full = getattr(logits, "full_tensor", None)
    logits = full() if full is not None else logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float() if logits.dtype == torch.float16
                                             else logits.flatten(0, 1), target.flatten(0, 1))
