"""The planner takes Hugging Face transformers models unchanged (issue 38 item 2; issue 37 item 5's roles): their
``ModelOutput`` and ``labels=``, MoE blocks (routers, fused experts, shared experts) with grouped-matmul FLOPs and
expert parallelism, DeepSeek's multi-head latent attention, fused qkv / gate-up projections, ``roles=`` on any
module, and every role error's advice followed to success. One process, meta device; configs built in code."""
import ast
import re
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("transformers")

from hyper_parallel.auto import Cluster, evaluate_plan, plan  # noqa: E402
from hyper_parallel.auto.model_stats import trace_model  # noqa: E402
from hyper_parallel.auto.roles import infer_roles  # noqa: E402
from tests.auto import hf_configs  # noqa: E402

SEQ = 16


def _info(model, roles=None):
    return infer_roles(model, trace_model(model, SEQ), roles)


def _in_last_block(info):
    last = info.block_names[-1]
    return {k[len(last) + 1:]: v for k, v in info.module_roles.items() if k.startswith(last + ".")}


def _small_plan(model, **kw):
    return plan(model, Cluster(4, 4, "1GiB"), global_batch=8, seq_len=SEQ, **kw)


def _hf_tiny(cls_name, **kw):
    import transformers
    base = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256, num_hidden_layers=2, intermediate_size=96, pad_token_id=0)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**dict(base, **kw)))


# ------------------------------------------------------------------ dense models, outputs, labels

@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_dense_hf_models_plan_with_no_loss_or_roles(name):
    model = hf_configs.build(name, tiny=True)
    info = _info(model)
    r = _in_last_block(info)
    assert [r[f"self_attn.{p}_proj"] for p in "qkvo"] == ["attention_q", "attention_k", "attention_v", "attention_o"]
    assert [r[f"mlp.{p}_proj"] for p in ("gate", "up", "down")] == ["mlp_gate", "mlp_up", "mlp_down"]
    assert info.module_roles["lm_head"] == "output" and info.module_roles["model.embed_tokens"] == "embedding"
    assert (info.n_heads, info.n_kv_heads, info.head_dim, info.vocab) == (4, 2, 16, 128)
    assert info.head_norms == ([f"model.layers.{i}.self_attn.{n}_norm" for i in range(2) for n in "kq"]
                               if name == "qwen3" else [])
    assert _small_plan(model)[0].step_time.total > 0
    p = evaluate_plan(model, Cluster(4, 4, "1GiB"), degrees={"tp": 2, "fsdp": 2}, global_batch=8, seq_len=SEQ)
    assert p.degrees["tp"] == 2 and p.memory.total > 0


def test_trace_passes_labels_and_differentiates_the_models_own_loss():
    class NeedsLabels(nn.Module):  # a *ForCausalLM-like model: returns an object with .loss (and .logits)
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 8)
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)) for _ in range(2)])
            self.head = nn.Linear(8, 32)

        def forward(self, input_ids, labels=None, use_cache=True):
            assert labels is not None and use_cache is False, "the trace must pass labels= and use_cache=False"
            h = self.emb(input_ids)
            for blk in self.layers:
                h = h + blk(h)
            logits = self.head(h)

            class Out(dict):
                pass
            out = Out(logits=logits, loss=F.cross_entropy(logits.flatten(0, 1), labels.flatten()) * 3)
            out.logits, out.loss = out["logits"], out["loss"]
            return out

    m = NeedsLabels().to("meta")
    t = trace_model(m, SEQ)
    assert t.fwd_flops > 0 and t.bwd_flops > 0
    with pytest.raises(TypeError, match=r"loss=callable\(output\)"):
        trace_model(m, SEQ, example_input=lambda b, s: {"input_ids": torch.zeros(b, s, dtype=torch.long,
                                                                                   device="meta"),
                                                         "labels": torch.zeros(b, s, dtype=torch.long,
                                                                               device="meta"),
                                                         "use_cache": False},
                    loss=lambda out: "not a tensor").bwd_flops


def test_sequence_classification_head_gets_no_token_labels():
    import transformers
    cfg = hf_configs.config("llama", tiny=True)
    cfg.num_labels, cfg.pad_token_id = 3, 0
    with torch.device("meta"):
        model = transformers.LlamaForSequenceClassification(cfg)
    info = _info(model)
    assert info.module_roles["score"] == "output" and _small_plan(model)[0].step_time.total > 0


def test_output_without_loss_or_logits_error_advice_works():
    class Weird(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 8)
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

        def forward(self, x):
            h = self.emb(x)
            for blk in self.layers:
                h = blk(h)
            return {"stats": [h]}  # nothing the planner can read

    m = Weird().to("meta")
    with pytest.raises(TypeError, match=r"pass loss=callable\(output\) -> scalar tensor"):
        trace_model(m, SEQ)
    assert trace_model(m, SEQ, loss=lambda out: out["stats"][0].float().pow(2).mean()).bwd_flops > 0


# ------------------------------------------------------------------ MoE

def _expert_fwd_flops(tokens, k, dim, hidden, gated=True):
    """A balanced grouped matmul: every routed row through up (gate and up fused) and down."""
    return 2 * tokens * k * dim * hidden * (3 if gated else 2)


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "deepseek-v3"])
def test_hf_moe_blocks_recognised_with_expert_flops_and_ep(name):
    model = hf_configs.build(name, tiny=True)
    cfg = model.config
    trace = trace_model(model, SEQ)
    info = infer_roles(model, trace)
    r = _in_last_block(info)
    assert r["mlp.experts"] == "experts" and r["mlp.gate"] == "router"
    n_exp = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    assert (info.num_experts, info.top_k) == (n_exp, cfg.num_experts_per_tok)
    hidden = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    assert info.expert_hidden == hidden
    experts = [k for k, v in info.module_roles.items() if v == "experts"]
    want = _expert_fwd_flops(SEQ, cfg.num_experts_per_tok, cfg.hidden_size, hidden)
    assert [trace.modules[e].fwd_flops for e in experts] == [want] * len(experts)
    if name == "deepseek-v3":
        assert [r[f"mlp.shared_experts.{p}_proj"] for p in ("gate", "up", "down")] == ["mlp_gate", "mlp_up",
                                                                                       "mlp_down"]
        assert info.block_is_moe == [False, True, True]
        assert any(p.shared for p in info.params)
    else:
        assert all(info.block_is_moe)
    plans = _small_plan(model, top_k=10_000)
    assert any(p.degrees["ep"] > 1 for p in plans), "expert parallelism must be searched"
    p = evaluate_plan(model, Cluster(4, 4, "1GiB"), degrees={"fsdp": 4, "ep": 2}, global_batch=8, seq_len=SEQ)
    ep_bytes = p.memory.params
    p1 = evaluate_plan(model, Cluster(4, 4, "1GiB"), degrees={"fsdp": 4}, global_batch=8, seq_len=SEQ)
    assert p.step_time.comm_per_dim.get("ep", 0) > 0 and ep_bytes > 0 and p1.step_time.compute > 0


@pytest.mark.parametrize("cls_name,kw,router,shared", [
    ("Qwen2MoeConfig", dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                            num_experts_per_tok=2), "mlp.gate", "mlp.shared_expert.down_proj"),
    ("Llama4TextConfig", dict(intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                              interleave_moe_layer_step=1), "feed_forward.router", "feed_forward.shared_expert.down_proj"),
    ("Glm4MoeConfig", dict(moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                           first_k_dense_replace=1, n_group=1, topk_group=1), "mlp.gate", "mlp.shared_experts.down_proj"),
    ("HunYuanMoEV1Config", dict(num_experts=4, moe_topk=2), "mlp.gate.wg", "mlp.shared_mlp.down_proj"),
])
def test_other_hf_moe_families(cls_name, kw, router, shared):
    """Other layouts of the same parts: transposed expert weights called on pre-routed rows (Llama-4), a shared
    expert's scalar gate (Qwen2-MoE), a router that is an nn.Linear inside a module (HunYuan)."""
    model = _hf_tiny(cls_name, **kw)
    trace = trace_model(model, SEQ)
    info = infer_roles(model, trace)
    r = _in_last_block(info)
    assert r[router] == "router" and r[shared] == "mlp_down" and info.num_experts in (4, 8)
    if cls_name == "Qwen2MoeConfig":
        assert r["mlp.shared_expert_gate"] == "router"
    experts = [k for k, v in info.module_roles.items() if v == "experts"]
    assert experts and all(trace.modules[e].fwd_flops > 0 for e in experts)
    assert any(p.degrees["ep"] > 1 for p in _small_plan(model, top_k=10_000))


def test_moe_trace_does_not_depend_on_dtype():
    """torch's meta grouped-matmul kernel takes bfloat16 only: the trace must not need it."""
    flops = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = hf_configs.build("mixtral", tiny=True, dtype=dtype)
        for impl in ("grouped_mm", "eager", "batched_mm"):
            model.config._experts_implementation = impl
            t = trace_model(model, SEQ)
            flops[(dtype, impl)] = (t.fwd_flops, t.bwd_flops)
    assert len(set(flops.values())) == 1, flops


# ------------------------------------------------------------------ attention variants

def test_deepseek_multi_head_latent_attention_roles():
    model = hf_configs.build("deepseek-v3", tiny=True)
    info = _info(model)
    r = _in_last_block(info)
    assert {k: r[f"self_attn.{k}"] for k in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")} \
        == {"q_a_proj": "attention_q_a", "q_b_proj": "attention_q", "kv_a_proj_with_mqa": "attention_kv_a",
            "kv_b_proj": "attention_kv", "o_proj": "attention_o"}
    assert r["self_attn.q_a_layernorm"] == "norm" and r["self_attn.kv_a_layernorm"] == "norm"
    assert info.head_norms == []  # the latents' norms are not per head
    cfg = model.config
    assert (info.n_heads, info.n_kv_heads, info.head_dim) == (4, 4, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)


def test_mla_without_query_lora():
    """DeepSeek-V2-Lite style: q_proj, then kv_a / kv_b."""
    cls, kw = hf_configs.TINY["deepseek-v3"]
    import transformers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**dict(kw, q_lora_rank=None)))
    r = _in_last_block(_info(model))
    assert (r["self_attn.q_proj"], r["self_attn.kv_a_proj_with_mqa"], r["self_attn.kv_b_proj"]) == \
        ("attention_q", "attention_kv_a", "attention_kv")


class FusedAttention(nn.Module):
    """Megatron-style fused qkv: per key/value group [q heads of the group, k, v]."""

    def __init__(self, d, heads, kv):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, d // heads
        self.qkv = nn.Linear(d, (heads + 2 * kv) * self.hd, bias=False)
        self.proj = nn.Linear(heads * self.hd, d, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        g = self.qkv(x).view(b, s, self.kv, (self.heads // self.kv + 2) * self.hd)
        q, k, v = g.split([self.heads // self.kv * self.hd, self.hd, self.hd], dim=-1)
        q = q.reshape(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(o.transpose(1, 2).reshape(b, s, -1))


class FusedMLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * h, bias=False)
        self.fc2 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


class FusedBlock(nn.Module):
    def __init__(self, d, heads, kv, h, extra=False):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn, self.mlp = FusedAttention(d, heads, kv), FusedMLP(d, h)
        self.extra = nn.Conv1d(d, d, 1) if extra else None

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        if self.extra is not None:
            x = x + self.extra(x.transpose(1, 2)).transpose(1, 2)
        return x + self.mlp(self.norm2(x))


class FusedModel(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, kv=2, h=48, n=3, extra=False):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.decoder = nn.ModuleList([FusedBlock(d, heads, kv, h, extra) for _ in range(n)])
        self.final_norm = nn.RMSNorm(d)
        self.output_layer = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.embedding(x)
        for blk in self.decoder:
            h = blk(h)
        return self.output_layer(self.final_norm(h))


def test_fused_qkv_and_gate_up_projections_recognised():
    model = FusedModel()
    info = _info(model)
    r = info.module_roles
    assert (r["decoder.1.attn.qkv"], r["decoder.1.attn.proj"]) == ("attention_qkv", "attention_o")
    assert (r["decoder.1.mlp.fc1"], r["decoder.1.mlp.fc2"]) == ("mlp_gate_up", "mlp_down")
    assert (info.n_heads, info.n_kv_heads, info.head_dim, info.ffn_hidden) == (4, 2, 8, 48)
    best = _small_plan(model)[0]
    assert best.step_time.total > 0
    p = evaluate_plan(model, Cluster(4, 4, "1GiB"), degrees={"tp": 2, "dp": 2}, global_batch=8, seq_len=SEQ)
    qkv = next(x for x in info.params if x.fqn == "decoder.0.attn.qkv.weight")
    assert qkv.role == "attention_qkv" and p.memory.params > 0


def test_hf_fused_qkv_and_gate_up_phi3():
    r = _in_last_block(_info(_hf_tiny("Phi3Config")))
    assert (r["self_attn.qkv_proj"], r["mlp.gate_up_proj"], r["mlp.down_proj"]) == ("attention_qkv", "mlp_gate_up",
                                                                                    "mlp_down")


def test_other_attention_implementation_traced_as_sdpa_on_the_copy_only():
    import transformers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_configs.config("llama", tiny=True),
                                                              attn_implementation="eager")
    calls = []

    class CountSdpa(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                calls.append(func)
            return func(*args, **(kwargs or {}))

    with CountSdpa():
        trace = trace_model(model, SEQ)
    assert model.config._attn_implementation == "eager"  # the user's model is left as it was
    assert calls and trace.modules["model.layers.0.self_attn"].sdpa_at == 3
    assert _in_last_block(infer_roles(model, trace))["self_attn.o_proj"] == "attention_o"


def test_eager_attention_recognised():
    """Gemma-2 has no sdpa path in transformers (soft-capping): its attention is found from q @ k^T."""
    model = _hf_tiny("Gemma2Config")
    assert model.config._attn_implementation == "eager"
    info = _info(model)
    r = _in_last_block(info)
    assert [r[f"self_attn.{p}_proj"] for p in "qkvo"] == ["attention_q", "attention_k", "attention_v", "attention_o"]
    assert (info.n_heads, info.n_kv_heads, info.head_dim) == (4, 2, 16)
    assert any(p.degrees["tp"] > 1 for p in _small_plan(model, top_k=10_000))


# ------------------------------------------------------------------ roles= overrides and error advice

def test_parameter_owned_by_attention_error_advice_works_when_followed():
    """GPT-OSS's attention owns its sinks directly (its children are the recognised projections)."""
    model = _hf_tiny("GptOssConfig", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn' \(GptOssAttention") as err:
        _small_plan(model)
    roles = _advised_roles(str(err.value), lambda k: "replicate")
    assert roles == {"model.layers.*.self_attn.sinks": "replicate"}
    info = _info(model, roles)
    role = {p.fqn: p.role for p in info.params}
    assert role["model.layers.1.self_attn.sinks"] == "replicate"
    assert role["model.layers.1.self_attn.q_proj.weight"] == "attention_q" and info.num_experts == 4
    assert any(p.degrees["ep"] > 1 for p in _small_plan(model, roles=roles, top_k=10_000))


def _advised_roles(message: str, role_for) -> dict:
    """The ``roles={...}`` dict an error message advises, with each ROLE placeholder filled by ``role_for(key)``."""
    found = re.findall(r"roles=(\{[^{}]*\})", message)
    assert found, message
    text = found[-1] if "for every block" not in message else re.findall(r"\(roles=(\{[^{}]*\})", message)[0]
    keys = re.findall(r"'([^']+)': ROLE", text)
    assert keys, message
    return {k: role_for(k) for k in keys}


def test_unknown_module_error_advice_works_when_followed():
    model = FusedModel(extra=True)
    with pytest.raises(ValueError, match=r"'decoder.0.extra' \(Conv1d") as err:
        _small_plan(model)
    roles = _advised_roles(str(err.value), lambda k: "replicate")
    assert roles == {"decoder.*.extra": "replicate"}
    info = _info(model, roles)
    assert all(info.module_roles[f"decoder.{i}.extra"] == "replicate" for i in range(3))
    assert _small_plan(model, roles=roles)[0].step_time.total > 0


class GatedAttention(nn.Module):
    """Four projections on the input before sdpa (q, k, v and an output gate): not a pattern the planner knows."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.a, self.b, self.c, self.g = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        bsz, s, d = x.shape
        q, k, v = (p(x).view(bsz, s, self.heads, self.hd).transpose(1, 2) for p in (self.a, self.b, self.c))
        gate = torch.sigmoid(self.g(x))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bsz, s, d)
        return self.o(o * gate)


class GatedModel(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, n=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.ModuleDict({"attn": GatedAttention(d, heads), "norm": nn.RMSNorm(d)})
                                     for _ in range(n)])
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for blk in self.blocks:
            h = h + blk["attn"](blk["norm"](h))
        return self.head(h)


def test_unrecognised_attention_error_advice_works_when_followed():
    model = GatedModel()
    with pytest.raises(ValueError, match="attention module 'blocks.0.attn'") as err:
        _small_plan(model)
    names = {"a": "attention_q", "b": "attention_k", "c": "attention_v", "g": "replicate", "o": "attention_o"}
    roles = _advised_roles(str(err.value), lambda k: names[k.rsplit(".", 1)[1]])
    assert set(roles) == {f"blocks.*.attn.{p}" for p in "abcgo"}
    info = _info(model, roles)
    assert info.module_roles["blocks.1.attn.a"] == "attention_q" and info.module_roles["blocks.1.attn.g"] == "replicate"
    assert "blocks.0.attn" in info.attention_modules and (info.n_heads, info.n_kv_heads) == (4, 4)
    assert _small_plan(model, roles=roles)[0].step_time.total > 0


def test_bad_roles_errors_and_their_advice():
    model = hf_configs.build("llama", tiny=True)
    with pytest.raises(ValueError, match="unknown role 'colwise'; expected one of embedding, attention_q"):
        _info(model, {"model.layers.0.mlp.up_proj": "colwise"})
    with pytest.raises(ValueError, match=r"no module 'model.layer.0.mlp'.*pattern with '\*'"):
        _info(model, {"model.layer.0.mlp": "replicate"})
    with pytest.raises(ValueError, match=r"no module 'model.layers.\*.ffn'"):
        _info(model, {"model.layers.*.ffn": "replicate"})
    # followed: a module name, or a pattern over the blocks
    assert _info(model, {"model.layers.0.mlp.up_proj": "mlp_up"}).module_roles["model.layers.0.mlp.up_proj"] == "mlp_up"


def test_roles_override_any_module_and_its_subtree():
    model = hf_configs.build("qwen3-moe", tiny=True)
    # a whole attention module: every parameter under it takes the role, nothing inside is inferred
    info = _info(model, {"model.layers.*.self_attn": "replicate"})
    roles_in_attn = {p.role for p in info.params if ".self_attn." in p.fqn}
    assert roles_in_attn == {"replicate"}
    assert not any(".self_attn." in k and v != "replicate" for k, v in info.module_roles.items())
    # a leaf inside a recognised module; a deeper key beats a shallower one
    info = _info(model, {"model.layers.*.self_attn": "replicate", "model.layers.1.self_attn.o_proj": "attention_o"})
    assert info.module_roles["model.layers.1.self_attn.o_proj"] == "attention_o"
    role = {p.fqn: p.role for p in info.params}
    assert role["model.layers.0.self_attn.o_proj.weight"] == "replicate"
    assert role["model.layers.1.self_attn.o_proj.weight"] == "attention_o"
    assert role["model.layers.1.self_attn.q_proj.weight"] == "replicate"
    # the router and the experts
    info = _info(model, {"model.layers.*.mlp.gate": "replicate"})
    assert info.module_roles["model.layers.0.mlp.gate"] == "replicate" and info.num_experts == 8
    # "experts" on a module that does not hold [E, ...] weights is refused with the reason
    dense = hf_configs.build("llama", tiny=True)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp' \(LlamaMLP\) tagged 'experts'.*\[E, \.\.\.\]"):
        _info(dense, {"model.layers.*.mlp": "experts"})


# ------------------------------------------------------------------ real sizes

@pytest.mark.parametrize("name", ["deepseek-v3", "mixtral-8x7b"])
def test_real_size_meta_config_plans_at_world_256(name):
    model = hf_configs.build(name)
    t0 = time.perf_counter()
    plans = plan(model, Cluster.preset("h100", 256), global_batch=512, seq_len=4096, top_k=100_000)
    took = time.perf_counter() - t0
    print(f"{name}: plan() at world 256 in {took:.2f} s; top {plans[0].summary()}")
    assert took < 60  # the target is 5 s (measured ~1 s on 2 loaded cores, see the report); not a benchmark
    assert any(p.degrees["ep"] > 1 for p in plans)
    info = plans[0]._model_info
    assert info.num_experts == model.config.num_local_experts
    assert sum(info.block_is_moe) == model.config.num_hidden_layers - getattr(model.config, "first_k_dense_replace", 0)


def test_apply_refuses_tp_on_fused_projections_by_name():
    """The planner costs fused projections under tp, but Plan.apply cannot cut them yet: it names each one and
    the fix (a plan without tp) before any parameter changes, instead of a shape error or mixed heads."""
    from hyper_parallel.auto.parallelize import _refuse_unsharded_roles
    info = _info(_hf_tiny("Phi3Config"))
    with pytest.raises(NotImplementedError, match=r"self_attn\.qkv_proj' \(a fused q/k/v projection.*"
                                                  r"parallelisms=\('dp', 'fsdp', 'pp', 'cp', 'ep'\)"):
        _refuse_unsharded_roles(info.module_roles)
    _refuse_unsharded_roles({"model.layers.0.self_attn.q_proj": "attention_q"})  # separate projections pass
