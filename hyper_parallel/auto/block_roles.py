"""Roles of the projections inside a block, read from the traced call order and data flow (never from names):
attention (separate q/k/v, fused qkv, fused kv, DeepSeek's multi-head latent attention), MLP (separate gate/up,
fused gate/up, no gate) and an MoE layer's router. ``roles.infer_roles`` calls these; the role names are
documented in ``hyper_parallel.auto.roles``.

"On the input" means: the Linear consumed the same tensor as the first Linear the module called (the module's
normalised hidden state), as opposed to a tensor derived from another projection's output.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch.nn as nn

from hyper_parallel.auto.model_stats import Trace


def attention_projections(before: List[str], after: List[str], trace: Trace) -> Optional[Dict[str, str]]:
    """``{linear fqn: role}`` of an attention module's direct Linears, called ``before`` and ``after`` its
    scaled_dot_product_attention, or None when the pattern is none of these:

    * q, k, v on the input, o after -> attention_q / _k / _v / _o;
    * one Linear on the input -> attention_qkv (fused); two -> attention_q and attention_kv (fused k and v);
    * multi-head latent attention (DeepSeek-V2/V3): the query group [q_a, q_b] or [q], then the key/value group
      [kv_a, kv_b], each group starting with a Linear on the input and its second Linear on a derived tensor
      -> attention_q_a, attention_q, attention_kv_a, attention_kv.
    """
    if len(after) != 1 or not before:
        return None
    ref = trace.linear_inputs.get(before[0])
    on_input = [lin for lin in before if trace.linear_inputs.get(lin) == ref]
    out = {after[0]: "attention_o"}
    if len(before) == len(on_input):
        names = {1: ("attention_qkv",), 2: ("attention_q", "attention_kv"),
                 3: ("attention_q", "attention_k", "attention_v")}.get(len(before))
        if names is None:
            return None
        out.update(zip(before, names))
        return out
    groups: List[List[str]] = []
    for lin in before:
        if lin in on_input:
            groups.append([lin])
        elif groups and len(groups[-1]) == 1:
            groups[-1].append(lin)
        else:
            return None
    if len(groups) != 2 or len(groups[1]) != 2:
        return None
    (q_group, (kv_a, kv_b)) = groups
    if len(q_group) == 1:
        out[q_group[0]] = "attention_q"
    else:
        out[q_group[0]], out[q_group[1]] = "attention_q_a", "attention_q"
    out[kv_a], out[kv_b] = "attention_kv_a", "attention_kv"
    return out


def mlp_projections(name: str, mods: Dict[str, nn.Module], trace: Trace) -> Optional[Dict[str, str]]:
    """``{linear fqn: role}`` of an MLP module (>= 2 direct Linear children, some on its input, the last one
    called on another tensor is the down projection), or None when ``name`` is not one.

    Several Linears on the input: the first is mlp_gate, the others mlp_up. One Linear on the input: mlp_gate_up
    when its output is twice the down projection's input (fused gate and up, chunked after it), else mlp_up."""
    if name not in trace.modules:
        return None
    order = [lin for lin in trace.modules[name].linear_order if lin.rsplit(".", 1)[0] == name]
    if len(set(order)) < 2:
        return None
    inp = trace.module_input_id.get(name, trace.linear_inputs.get(order[0]))
    on_input = [lin for lin in order if trace.linear_inputs.get(lin) == inp]
    if not on_input or len(on_input) == len(order):
        return None
    down = [lin for lin in order if lin not in on_input][-1]
    out = {}
    if len(on_input) == 1:
        up, dn = mods[on_input[0]], mods[down]
        fused = isinstance(up, nn.Linear) and isinstance(dn, nn.Linear) and up.out_features == 2 * dn.in_features
        out[on_input[0]] = "mlp_gate_up" if fused else "mlp_up"
    else:
        for i, lin in enumerate(on_input):
            out.setdefault(lin, "mlp_gate" if i == 0 else "mlp_up")
    out[down] = "mlp_down"
    return out


def router_modules(moe: str, mods: Dict[str, nn.Module], n_experts: int, taken) -> List[str]:
    """The MoE layer ``moe``'s routers: modules in it not already tagged (``taken(fqn)``: the experts, shared
    experts, user overrides) that are a Linear with at most ``n_experts`` outputs (a router, or a shared
    expert's scalar gate) or own a 2-D ``[n_experts, dim]`` weight (Hugging Face's ``*TopKRouter``)."""
    out = []
    for n, c in mods[moe].named_modules():
        full = f"{moe}.{n}" if n else moe
        if not n or taken(full):
            continue
        if isinstance(c, nn.Linear):
            if c.out_features <= n_experts:
                out.append(full)
            continue
        own = list(c.parameters(recurse=False))
        if own and any(p.dim() == 2 and p.shape[0] == n_experts for p in own) and all(p.dim() <= 2 for p in own):
            out.append(full)
    return out
