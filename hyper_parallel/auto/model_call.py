"""How the planner's trace calls a model and finds the loss to differentiate, for plain ``nn.Module`` models and
Hugging Face ``transformers`` models alike (no import of transformers: duck typing).

* **Input.** ``example_input(batch, seq_len)`` may return a tensor (one positional argument), a tuple
  (positional arguments) or a dict (keyword arguments, e.g. ``{"input_ids": ..., "labels": ...}``). Without it
  the model gets ``[batch, seq_len]`` int64 token ids; a model whose ``forward`` takes ``labels`` (Hugging
  Face's ``*ForCausalLM``; not its sequence-classification / QA / multiple-choice heads, whose labels are not
  one per token) also gets ``labels=`` (the token ids), so it computes its own loss as in training, and
  ``use_cache=False`` where ``forward`` takes it (training keeps no KV cache).
* **Output.** ``loss(output)`` when given. Otherwise: an output with a tensor ``.loss`` / ``["loss"]``
  (Hugging Face ``ModelOutput``) is the loss; else ``.logits`` / ``["logits"]``, a dict's first tensor, a
  tuple's first element or the output itself is the logits: next-token cross-entropy for ``[batch, seq, vocab]`` floats, the mean
  otherwise.
* **Attention kernel.** A Hugging Face model traced with another attention implementation ("eager", flash,
  flex) is switched to "sdpa" on the meta copy: the planner reads attention from
  ``F.scaled_dot_product_attention`` and counts it as a fused kernel.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


# heads whose labels are not one per token: the trace feeds them no labels (``example_input`` may)
_NOT_TOKEN_LABELS = ("ForSequenceClassification", "ForQuestionAnswering", "ForMultipleChoice")


def _forward_params(model: nn.Module):
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def use_sdpa(meta: nn.Module) -> None:
    """Switch a Hugging Face model copy to the "sdpa" attention implementation (no-op for other models)."""
    config = getattr(meta, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl is None or impl == "sdpa" or not hasattr(meta, "set_attn_implementation"):
        return
    try:
        meta.set_attn_implementation("sdpa")
    except Exception:  # noqa: BLE001 - a model without an sdpa path keeps its own (and fails role inference clearly)
        pass


def call_model(meta: nn.Module, batch: int, seq_len: int, example_input: Optional[Callable] = None) -> Any:
    """Run ``meta``'s forward on the trace's input (see the module docstring)."""
    use_sdpa(meta)
    if example_input is not None:
        x = example_input(batch, seq_len)
        if isinstance(x, dict):
            return meta(**x)
        return meta(*x) if isinstance(x, tuple) else meta(x)
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    params = _forward_params(meta)
    kwargs = {}
    if "labels" in params and not type(meta).__name__.endswith(_NOT_TOKEN_LABELS):
        kwargs["labels"] = ids
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return meta(ids, **kwargs)


def _field(out: Any, name: str):
    if isinstance(out, dict):
        v = out.get(name)
    else:
        v = getattr(out, name, None)
    return v if isinstance(v, torch.Tensor) else None


def loss_of(out: Any, loss: Optional[Callable] = None) -> torch.Tensor:
    """The scalar to differentiate in the trace (see the module docstring)."""
    if loss is not None:
        val = loss(out[0] if isinstance(out, (tuple, list)) else out)
        if not isinstance(val, torch.Tensor) or val.numel() != 1:
            raise TypeError(f"plan(): loss(output) returned {type(val).__name__}"
                            + (f" of shape {tuple(val.shape)}" if isinstance(val, torch.Tensor) else "")
                            + "; expected a scalar tensor (pass loss=callable(output) -> scalar tensor)")
        return val
    given = _field(out, "loss")
    if given is not None:
        return given
    logits = _field(out, "logits")
    if logits is None and isinstance(out, dict):  # another ModelOutput (e.g. last_hidden_state): its first tensor
        logits = next((v for v in out.values() if isinstance(v, torch.Tensor)), None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"plan(): the model returned {type(out).__name__}, which has no tensor 'loss' or 'logits' "
                        "and is not a tensor; pass loss=callable(output) -> scalar tensor to plan()/evaluate_plan()")
    if logits.dim() == 3 and logits.is_floating_point():  # logits: next-token cross-entropy
        tgt = torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.long, device=logits.device)
        return F.cross_entropy(logits.flatten(0, 1), tgt)
    return logits.float().mean()
