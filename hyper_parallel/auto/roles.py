"""Role of every parameter, read from the module tree and the traced forward (no per-model table).

Rules (docs/auto_parallel.md "Roles"):

* ``nn.Embedding`` -> ``embedding``; a parameter-only leaf whose parameters are all 1-D -> ``norm``.
* A module during whose forward ``F.scaled_dot_product_attention`` ran, owning ``nn.Linear`` children:
  attention. The Linears called before the sdpa are ``attention_q``, ``attention_k``, ``attention_v``
  (call order); the one after it is ``attention_o``.
* A module with the GroupedExperts contract (3-D ``[E, ...]`` parameters) -> ``experts``; its parent is
  an MoE layer, whose Linear with ``E`` outputs is the ``router``; an MLP inside it is a shared expert.
* Another module whose direct children are >= 2 Linears: an MLP. The last Linear called whose input is
  not the module's input is ``mlp_down``; the first Linear on the input ``mlp_gate``, others ``mlp_up``.
* A Linear outside every repeated block -> ``output`` (the head).
* The blocks are the children of the largest ``ModuleList``/``ModuleDict`` of the model.

Anything else that owns parameters raises ``ValueError`` naming the module and the ``roles=`` override
(``roles={"path.to.module": "replicate"}`` keeps its parameters replicated over tp and sharded by FSDP).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch.nn as nn

from hyper_parallel.auto.model_stats import Trace, is_grouped_experts

ROLES = ("embedding", "attention_q", "attention_k", "attention_v", "attention_o", "mlp_gate", "mlp_up",
         "mlp_down", "norm", "output", "router", "experts", "replicate")
COLWISE = {"attention_q", "attention_k", "attention_v", "mlp_gate", "mlp_up", "output"}
ROWWISE = {"attention_o", "mlp_down", "embedding"}


@dataclasses.dataclass
class ParamInfo:
    fqn: str               # parameter name in model.named_parameters()
    module: str            # owning module fqn
    attr: str
    shape: tuple
    dtype: object
    role: str
    block: Optional[int]   # index of the repeated block holding it (None: embedding / head / final norm)
    shared: bool = False   # inside an MoE layer's shared expert


@dataclasses.dataclass
class ModelInfo:
    params: List[ParamInfo]
    blocks_path: str                  # fqn of the ModuleList/ModuleDict of blocks
    block_names: List[str]            # fqn of each block
    block_is_moe: List[bool]
    module_roles: Dict[str, str]      # module fqn -> role (Linear / Embedding / experts / norm / ...)
    attention_modules: List[str]
    mlp_modules: List[str]
    moe_modules: List[str]
    norm_modules: List[str]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dim: int
    vocab: int
    ffn_hidden: int
    num_experts: int
    top_k: int
    expert_hidden: int
    n_args: Dict[str, int] = dataclasses.field(default_factory=dict)


def _find_blocks(model: nn.Module):
    best, best_n = None, 0
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            n = sum(1 for c in m.children() if any(True for _ in c.parameters()))
            if n > best_n:
                best, best_n = name, n
    if best is None:
        raise ValueError("plan(): found no ModuleList/ModuleDict of repeated blocks in the model; the planner "
                         "splits pipelines and FSDP groups by the blocks of a model's largest ModuleList/ModuleDict")
    container = model.get_submodule(best)
    return best, [f"{best}.{n}" if best else n for n, _ in container.named_children()]


def infer_roles(model: nn.Module, trace: Trace, roles: Optional[Dict[str, str]] = None) -> ModelInfo:
    roles = dict(roles or {})
    for k, v in roles.items():
        if v not in ROLES:
            raise ValueError(f"roles={{{k!r}: {v!r}}}: unknown role {v!r}; expected one of {', '.join(ROLES)}")
    mods = dict(model.named_modules())
    for k in roles:
        if k not in mods:
            raise ValueError(f"roles: the model has no module {k!r}")
    blocks_path, block_names = _find_blocks(model)
    mrole: Dict[str, str] = {}
    attention, mlps, moes, norms = [], [], [], []
    top_k = 0
    num_experts = 0
    expert_hidden = 0
    # grouped experts and their MoE parents
    for name, m in mods.items():
        if name in roles:
            continue
        if is_grouped_experts(m):
            mrole[name] = "experts"
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            moes.append(parent)
            E = next(m.parameters()).shape[0]
            num_experts = max(num_experts, E)
            ps = dict(m.named_parameters(recurse=False))
            expert_hidden = ps["w1"].shape[1] if "w1" in ps else min(next(m.parameters()).shape[1:])
            top_k = max(top_k, _find_top_k(mods[parent]))
    for name, t in trace.modules.items():
        if name in roles or name not in mods:
            continue
        if t.sdpa_at is not None and t.linear_order:
            direct = [l for l in t.linear_order if l.rsplit(".", 1)[0] == name]
            if not direct:
                continue
            attention.append(name)
            before, after = direct[: t.sdpa_at], direct[t.sdpa_at:]
            if len(before) != 3 or len(after) != 1:
                raise ValueError(f"plan(): attention module {name!r} ({type(mods[name]).__name__}) calls Linears "
                                 f"{before} before scaled_dot_product_attention and {after} after; the planner "
                                 "expects separate q, k, v projections and one output projection. Pass roles= "
                                 "(e.g. roles={" + repr(before[0] if before else name) + ": 'replicate'}) to "
                                 "tag them yourself")
            for l, r in zip(before, ("attention_q", "attention_k", "attention_v")):
                mrole.setdefault(l, r)
            mrole.setdefault(after[0], "attention_o")
    attn_set = set(attention)
    for name, m in mods.items():
        if name in roles or name in attn_set or name in mrole:
            continue
        lin = [n for n, c in m.named_children() if isinstance(c, nn.Linear)]
        if len(lin) >= 2 and name in trace.modules:
            order = [l for l in trace.modules[name].linear_order if l.rsplit(".", 1)[0] == name]
            inp = trace.module_input_id.get(name)
            on_input = [l for l in order if trace.linear_inputs.get(l) == inp]
            if not on_input or len(on_input) == len(order):
                continue
            mlps.append(name)
            down = [l for l in order if l not in on_input][-1]
            for i, l in enumerate(on_input):
                mrole.setdefault(l, "mlp_gate" if i == 0 and len(on_input) > 1 else "mlp_up")
            mrole.setdefault(down, "mlp_down")
    for moe in moes:
        E = next(mods[[k for k, v in mrole.items() if v == "experts" and k.startswith(moe + ".")][0]].parameters()).shape[0]
        for n, c in mods[moe].named_modules():
            full = f"{moe}.{n}" if n else moe
            if isinstance(c, nn.Linear) and c.out_features == E and full not in mrole:
                mrole[full] = "router"
    in_block = lambda n: any(n == b or n.startswith(b + ".") for b in block_names)
    for name, m in mods.items():
        if name in roles or name in mrole:
            continue
        own = list(m.parameters(recurse=False))
        if not own:
            continue
        if isinstance(m, nn.Embedding):
            mrole[name] = "embedding"
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or (not list(m.children()) and all(p.dim() == 1 for p in own)):
            mrole[name] = "norm"
            norms.append(name)
        elif isinstance(m, nn.Linear) and not in_block(name):
            mrole[name] = "output"
        else:
            raise ValueError(
                f"plan(): cannot tell the role of module {name!r} ({type(m).__name__}, parameters "
                f"{[n for n, _ in m.named_parameters(recurse=False)]}); pass roles={{{name!r}: ROLE}} with ROLE one "
                f"of {', '.join(ROLES)} (e.g. 'replicate': replicated over tp, sharded by fsdp)")
    mrole.update(roles)
    norms = sorted(set(norms) | {k for k, v in roles.items() if v == "norm"})
    # parameters
    params = []
    block_index = {b: i for i, b in enumerate(block_names)}
    seen = set()
    for mname, m in mods.items():
        for attr, p in m.named_parameters(recurse=False):
            if id(p) in seen:
                continue  # tied: counted once, under its first owner
            seen.add(id(p))
            fqn = f"{mname}.{attr}" if mname else attr
            role = mrole.get(mname)
            if role is None:
                anc = [a for a in mrole if mname.startswith(a + ".")]
                role = mrole[max(anc, key=len)] if anc else None
            if role is None:
                raise ValueError(f"plan(): parameter {fqn!r} has no role; pass roles={{{mname!r}: ROLE}}")
            blk = None
            for b, i in block_index.items():
                if mname == b or mname.startswith(b + "."):
                    blk = i
                    break
            shared = any(mname.startswith(moe + ".") for moe in moes) and role.startswith("mlp")
            params.append(ParamInfo(fqn, mname, attr, tuple(p.shape), p.dtype, role, blk, shared))
    by_role = lambda r: [mods[k] for k, v in mrole.items() if v == r and isinstance(mods.get(k), nn.Linear)]
    wq, wk = by_role("attention_q"), by_role("attention_k")
    sd = trace.sdpa_shapes[0] if trace.sdpa_shapes else None
    head_dim = sd[0][-1] if sd else 1
    n_heads = sd[0][1] if sd else 1
    n_kv = (wk[0].out_features // head_dim) if wk else n_heads
    emb = [mods[k] for k, v in mrole.items() if v == "embedding"]
    out = by_role("output")
    vocab = emb[0].num_embeddings if emb else (out[0].out_features if out else 1)
    dim = emb[0].embedding_dim if emb else (wq[0].in_features if wq else 1)
    ups = by_role("mlp_up") + by_role("mlp_gate")
    ffn = max((l.out_features for l in ups), default=1)
    return ModelInfo(params, blocks_path, block_names,
                     [any(m.startswith(b + ".") for m in moes) for b in block_names], mrole, attention, mlps,
                     sorted(set(moes)), norms, n_heads, n_kv, head_dim, dim, vocab, ffn, num_experts, top_k or 1,
                     expert_hidden, dict(trace.input_arg_counts))


def _find_top_k(moe: nn.Module) -> int:
    for m in moe.modules():
        for holder in (m, getattr(m, "args", None), getattr(m, "config", None)):
            k = getattr(holder, "top_k", None) if holder is not None else None
            if isinstance(k, int) and k > 0:
                return k
    return 1
