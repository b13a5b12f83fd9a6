"""Role of every parameter, read from the module tree and the traced forward (no per-model table).

Role names (stable: ``Plan.apply`` and the Hugging Face support consume them; docs/auto_parallel.md "Roles"):

==================  ==============================================================  =========================
role                what it is                                                      tensor parallel layout
==================  ==============================================================  =========================
embedding           ``nn.Embedding``                                                rowwise (vocab rows)
attention_q         query projection (DeepSeek MLA: ``q_b_proj``, or ``q_proj``)    colwise (by heads)
attention_k         key projection                                                  colwise (by heads)
attention_v         value projection                                                colwise (by heads)
attention_qkv       one Linear computing q, k and v (fused)                         colwise (by heads) [1]
attention_kv        one Linear computing k and v (fused; MLA's ``kv_b_proj``)       colwise (by heads)
attention_q_a       MLA's query down-projection to the latent (``q_a_proj``)        replicated [2]
attention_kv_a      MLA's key/value down-projection (``kv_a_proj_with_mqa``)        replicated [2]
attention_o         output projection                                               rowwise
mlp_gate            gate projection of a gated MLP                                  colwise
mlp_up              up projection                                                   colwise
mlp_gate_up         one Linear computing gate and up (fused)                        colwise [1]
mlp_down            down projection                                                 rowwise
norm                a normalisation (parameters all 1-D)                            replicated (SP: sequence)
output              the head (a Linear outside the blocks)                          colwise (vocab)
router              an MoE layer's router / gate (``nn.Linear`` or a ``[E, dim]``
                    weight such as ``MixtralTopKRouter``)                           replicated
experts             grouped experts (``[E, ...]`` parameters)                       ``Shard(0)`` over ep
replicate           anything else the user tags: whole over tp, sharded by FSDP     replicated
==================  ==============================================================  =========================

[1] The fused projections' output columns are split contiguously over tp, which is right for Megatron's
interleaved layouts (q, k, v of one key/value head group together; gate and up rows interleaved); a plain
concatenation ``[Q; K; V]`` / ``[gate; up]`` needs a strided split on apply. [2] As torchtitan's DeepSeek-V3
(``NoParallel``): the small latent stays whole, the up-projections after it are split by heads.

Rules (the trace: ``model_stats``; the projection patterns: ``block_roles``):

* ``nn.Embedding`` -> ``embedding``; a parameter-only leaf whose parameters are all 1-D -> ``norm``.
* A module during whose forward ``F.scaled_dot_product_attention`` ran, owning ``nn.Linear`` children:
  attention; its Linears called before the sdpa are the q/k/v (or qkv, kv, MLA) projections
  (``block_roles.attention_projections``), the one after it ``attention_o``.
* A grouped-expert module (``expert_modules.is_grouped_experts``: the library's GroupedExperts or Hugging
  Face's fused experts) -> ``experts``; its parent is an MoE layer, whose Linear with at most ``E`` outputs or
  module with an ``[E, dim]`` weight is the ``router``; an MLP inside it is a shared expert.
* Another module whose direct children are >= 2 Linears: an MLP (``block_roles.mlp_projections``).
* A Linear outside every repeated block -> ``output`` (the head).
* The blocks are the children of the largest ``ModuleList``/``ModuleDict`` of the model.

``roles=`` overrides: ``{module: role}`` for any module; the role covers the module's whole subtree (nothing
inside it is inferred) unless a deeper key names a descendant. A key may be a pattern where ``*`` stands for
one dotted name component (``"model.layers.*.mlp.gate"``); a key matching no module is an error. Tagging
``experts`` makes a module grouped experts (its parent the MoE layer). Anything else that owns parameters
raises ``ValueError`` naming the module and the override that lifts it.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional

import torch.nn as nn

from hyper_parallel.auto.block_roles import attention_projections, mlp_projections, router_modules
from hyper_parallel.auto.expert_modules import expert_hidden_size, is_grouped_experts, num_experts
from hyper_parallel.auto.model_stats import Trace, find_blocks

ROLES = ("embedding", "attention_q", "attention_k", "attention_v", "attention_qkv", "attention_kv",
         "attention_q_a", "attention_kv_a", "attention_o", "mlp_gate", "mlp_up", "mlp_gate_up", "mlp_down", "norm",
         "output", "router", "experts", "replicate")
COLWISE = {"attention_q", "attention_k", "attention_v", "attention_qkv", "attention_kv", "mlp_gate", "mlp_up",
           "mlp_gate_up", "output"}
ROWWISE = {"attention_o", "mlp_down", "embedding"}
ATTENTION_ROLES = {"attention_q", "attention_k", "attention_v", "attention_qkv", "attention_kv", "attention_q_a",
                   "attention_kv_a", "attention_o"}
MLP_ROLES = {"mlp_gate", "mlp_up", "mlp_gate_up", "mlp_down"}


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
    # norms inside attention applied per head (Qwen3's q_norm / k_norm: weight of head_dim; split with the heads
    # under tp), as opposed to norms of a whole latent (an MLA attention's q_a_layernorm / kv_a_layernorm: replicated)
    head_norms: List[str] = dataclasses.field(default_factory=list)


def _ancestors(fqn: str):
    """Enclosing module names of ``fqn``, nearest first (the root ``""`` last)."""
    while fqn:
        fqn = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        yield fqn


def _user_roles(roles: Optional[Dict[str, str]], mods: Dict[str, nn.Module], param_names: List[str]):
    """``roles=`` with patterns expanded: ({module: role}, {parameter: role}); bad keys and roles raise."""
    param_set = set(param_names)
    by_module: Dict[str, str] = {}
    by_param: Dict[str, str] = {}
    for key, role in (roles or {}).items():
        if role not in ROLES:
            raise ValueError(f"roles={{{key!r}: {role!r}}}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if "*" in key:
            rx = re.compile("".join("[^.]*" if ch == "*" else re.escape(ch) for ch in key) + r"\Z")
            hits = [n for n in mods if n and rx.match(n)]
            target = by_module
            if not hits:
                hits, target = [n for n in param_names if rx.match(n)], by_param
        else:
            hits, target = ([key], by_module) if key in mods else ([key], by_param) if key in param_set else ([], None)
        if not hits:
            raise ValueError(f"roles: the model has no module {key!r} (expected a name from model.named_modules() or "
                             "model.named_parameters(), or a pattern with '*' for one dotted name component, e.g. "
                             "'model.layers.*.mlp')")
        for n in hits:  # an exact name beats a pattern
            target.setdefault(n, role) if "*" in key else target.__setitem__(n, role)
    return by_module, by_param


def _holds_experts(module: nn.Module) -> bool:
    own = list(module.parameters(recurse=False))
    return bool(own) and all(p.dim() >= 2 for p in own) and len({p.shape[0] for p in own}) == 1


def _pattern(name: str, block_names: List[str]) -> str:
    """``name`` with its block index as ``*`` (the override then covers every block)."""
    for b in block_names:
        if name == b or name.startswith(b + "."):
            head = b.rpartition(".")[0]
            return (f"{head}.*" if head else "*") + name[len(b):]
    return name


def infer_roles(model: nn.Module, trace: Trace, roles: Optional[Dict[str, str]] = None) -> ModelInfo:
    mods = dict(model.named_modules())
    user, user_params = _user_roles(roles, mods, [n for n, _ in model.named_parameters(remove_duplicate=False)])
    covered = {n for n in mods if n in user or any(a in user for a in _ancestors(n))}
    blocks = find_blocks(model)
    if blocks is None:
        raise ValueError("plan(): found no ModuleList/ModuleDict of repeated blocks in the model; the planner "
                         "splits pipelines and FSDP groups by the blocks of a model's largest ModuleList/ModuleDict")
    blocks_path = blocks[0]
    block_names = [f"{blocks_path}.{n}" if blocks_path else n for n in blocks[1]]
    mrole: Dict[str, str] = {}
    attention, mlps, moes, norms = [], [], [], []
    top_k = n_exp = hidden = 0
    # grouped experts (found, or tagged by the user) and their MoE parents
    for name, m in mods.items():
        if not name or not (user.get(name) == "experts" or (name not in covered and is_grouped_experts(m))):
            continue
        if name in user and not _holds_experts(m):
            raise ValueError(f"roles: {name!r} ({type(m).__name__}) tagged 'experts' must hold every expert's weights "
                             "as direct [E, ...] parameters with one leading E (the grouped-experts layout); tag its "
                             "parts with other roles instead")
        mrole[name] = "experts"
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        moes.append(parent)
        n_exp = max(n_exp, num_experts(m))
        hidden = expert_hidden_size(m) if is_grouped_experts(m) else hidden
        top_k = max(top_k, _find_top_k(mods[parent]))
    for name, t in trace.modules.items():
        if name in covered or name not in mods or t.sdpa_at is None or not t.linear_order:
            continue
        direct = [lin for lin in t.linear_order if lin.rsplit(".", 1)[0] == name]
        if not direct:
            continue
        attention.append(name)
        before, after = direct[: t.sdpa_at], direct[t.sdpa_at:]
        found = attention_projections(before, after, trace)
        if found is None:
            if all(lin in covered for lin in direct):
                continue  # the user tagged every projection
            todo = [lin for lin in direct if lin not in covered]
            example = ", ".join(f"{_pattern(lin, block_names)!r}: ROLE" for lin in todo)
            raise ValueError(
                f"plan(): attention module {name!r} ({type(mods[name]).__name__}) calls Linears {before} before "
                f"scaled_dot_product_attention and {after} after; the planner recognises separate q, k, v, fused "
                "qkv, q + fused kv and multi-head latent attention (q_a, q_b, kv_a, kv_b) projections before it "
                f"and one output projection after it. Tag them yourself: roles={{{example}}} with ROLE one of "
                f"{', '.join(sorted(ATTENTION_ROLES))} or 'replicate'")
        for lin, r in found.items():
            mrole.setdefault(lin, r)
    attn_set = set(attention)
    for name, m in mods.items():
        if name in covered or name in attn_set or name in mrole:
            continue
        if sum(1 for c in m.children() if isinstance(c, nn.Linear)) < 2:
            continue
        found = mlp_projections(name, mods, trace)
        if found is None:
            continue
        mlps.append(name)
        for lin, r in found.items():
            mrole.setdefault(lin, r)
    for moe in sorted(set(moes)):
        e = max(num_experts(mods[k]) for k, v in mrole.items() if v == "experts" and k.startswith(moe + "."))
        taken = lambda fqn: fqn in mrole or fqn in covered or any(a in mrole for a in _ancestors(fqn)
                                                                  if a.startswith(moe + "."))
        for r in router_modules(moe, mods, e, taken):
            mrole[r] = "router"
    block_set = set(block_names)
    in_block = lambda fqn: any(a in block_set for a in _ancestors(fqn)) or fqn in block_set
    for name, m in mods.items():
        if name in covered or name in mrole:
            continue
        own = list(m.parameters(recurse=False))
        if not own:
            continue
        if any(a in mrole for a in _ancestors(name)):
            continue  # inside a tagged module (the experts' activation, a router's parts)
        if all((f"{name}.{a}" if name else a) in user_params for a, _ in m.named_parameters(recurse=False)):
            continue  # the user tagged each of its own parameters
        if isinstance(m, nn.Embedding):
            mrole[name] = "embedding"
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or (not list(m.children()) and all(p.dim() == 1 for p in own)):
            mrole[name] = "norm"
            norms.append(name)
        elif isinstance(m, nn.Linear) and not in_block(name):
            mrole[name] = "output"
        else:
            raise ValueError(_unknown_module_message(name, m, block_names))
    mrole.update(user)
    norms = sorted(set(norms) | {k for k, v in user.items() if v == "norm"})
    attention = sorted(set(attention) | {a for lin, r in user.items() if r in ATTENTION_ROLES
                                         for a in [lin.rsplit(".", 1)[0]] if a in trace.modules
                                         and trace.modules[a].sdpa_at is not None})
    params = _params(mods, mrole, block_names, moes, user_params)
    sizes = _sizes(mods, mrole, trace)
    head_dim = sizes[2]
    latent = {lin.rsplit(".", 1)[0] for lin, r in mrole.items() if r in ("attention_q_a", "attention_kv_a")}
    head_norms = [n for n in norms if any(n.startswith(a + ".") for a in attention if a not in latent)
                  and sum(p.numel() for p in mods[n].parameters(recurse=False)) in (head_dim, 2 * head_dim)]
    return ModelInfo(params, blocks_path, block_names,
                     [any(m == b or m.startswith(b + ".") for m in moes) for b in block_names], mrole, attention, mlps,
                     sorted(set(moes)), norms, *sizes, n_exp, top_k or 1, hidden, dict(trace.input_arg_counts),
                     head_norms)


def _unknown_module_message(name: str, module: nn.Module, block_names: List[str]) -> str:
    own = [a for a, _ in module.named_parameters(recurse=False)]
    head = f"plan(): cannot tell the role of module {name!r} ({type(module).__name__}, parameters {own}); "
    tail = f" with ROLE one of {', '.join(ROLES)} (e.g. 'replicate': replicated over tp, sharded by fsdp)"
    if any(True for c in module.children() for _ in c.parameters()):  # its children have roles: tag its own parameters
        keys = ", ".join(f"{_pattern(f'{name}.{a}' if name else a, block_names)!r}: ROLE" for a in own)
        return (head + f"pass roles={{{keys}}} for its own parameters (a key naming the module would set the "
                "role of its whole subtree)" + tail)
    pattern = _pattern(name, block_names)
    return (head + f"pass roles={{{name!r}: ROLE}}"
            + (f" (roles={{{pattern!r}: ROLE}} for every block)" if pattern != name else "") + tail)


def _params(mods, mrole, block_names, moes, user_params) -> List[ParamInfo]:
    block_index = {b: i for i, b in enumerate(block_names)}
    moe_set = set(moes)
    params, seen = [], set()
    for mname, m in mods.items():
        own = list(m.named_parameters(recurse=False))
        if not own:
            continue
        chain = [mname] + list(_ancestors(mname))
        role = next((mrole[a] for a in chain if a in mrole), None)
        blk = next((block_index[a] for a in chain if a in block_index), None)
        in_moe = any(a in moe_set for a in chain[1:])
        for attr, p in own:
            if id(p) in seen:
                continue  # tied: counted once, under its first owner
            seen.add(id(p))
            fqn = f"{mname}.{attr}" if mname else attr
            p_role = user_params.get(fqn, role)
            if p_role is None:
                raise ValueError(f"plan(): parameter {fqn!r} has no role; pass roles={{{fqn!r}: ROLE}}")
            params.append(ParamInfo(fqn, mname, attr, tuple(p.shape), p.dtype, p_role, blk,
                                    in_moe and p_role in MLP_ROLES))
    return params


def _sizes(mods, mrole, trace):
    """(n_heads, n_kv_heads, head_dim, dim, vocab, ffn_hidden) from the projections and the sdpa shapes."""
    by_role = lambda role: [mods[k] for k, v in mrole.items() if v == role and isinstance(mods.get(k), nn.Linear)]
    sd = trace.sdpa_shapes[0] if trace.sdpa_shapes else None
    head_dim = sd[0][-1] if sd else 1
    n_heads = sd[0][1] if sd else 1
    wq, wk, qkv, kv = by_role("attention_q"), by_role("attention_k"), by_role("attention_qkv"), by_role("attention_kv")
    if wk:
        n_kv = wk[0].out_features // head_dim
    elif qkv:
        n_kv = max((qkv[0].out_features - n_heads * head_dim) // (2 * head_dim), 1)
    elif kv and not by_role("attention_kv_a"):
        n_kv = max(kv[0].out_features // (2 * head_dim), 1)
    else:
        n_kv = n_heads  # multi-head latent attention: every head has its own keys and values
    emb = [mods[k] for k, v in mrole.items() if v == "embedding" and isinstance(mods.get(k), nn.Embedding)]
    out = by_role("output")
    vocab = emb[0].num_embeddings if emb else (out[0].out_features if out else 1)
    first = (wq or qkv or by_role("attention_q_a"))
    dim = emb[0].embedding_dim if emb else (first[0].in_features if first else 1)
    # 0 without a dense MLP (every block MoE): grouped experts stay whole over tp, nothing for tp to divide
    ffn = max([lin.out_features for lin in by_role("mlp_up") + by_role("mlp_gate")]
              + [lin.out_features // 2 for lin in by_role("mlp_gate_up")], default=0)
    return n_heads, n_kv, head_dim, dim, vocab, ffn


def _find_top_k(moe: nn.Module) -> int:
    """Experts per token: a ``top_k`` attribute of the MoE layer or a module in it (router), or of their
    ``args``; else ``num_experts_per_tok`` of a Hugging Face config."""
    for m in moe.modules():
        for holder in (m, getattr(m, "args", None)):
            k = getattr(holder, "top_k", None) if holder is not None else None
            if isinstance(k, int) and not isinstance(k, bool) and k > 0:
                return k
    for m in moe.modules():
        k = getattr(getattr(m, "config", None), "num_experts_per_tok", None)
        if isinstance(k, int) and k > 0:
            return k
    return 1
