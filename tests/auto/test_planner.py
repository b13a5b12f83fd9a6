"""hyper_parallel.auto in one process (meta device; pure arithmetic): Cluster, roles, search, errors, speed."""
import time

import pytest
import torch
import torch.nn as nn

from examples.llama.configs import get_config
from examples.llama.model import ModelArgs, Transformer
from examples.llama.moe import MoEArgs
from hyper_parallel.auto import Cluster, evaluate_plan, explain_rejections, plan
from hyper_parallel.auto.model_stats import trace_model
from hyper_parallel.auto.roles import infer_roles
from tests.auto.models import Renamed

GiB = 2**30


def _meta(args):
    with torch.device("meta"):
        return Transformer(args, init_seed=None)


def llama_70b():
    return ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                     ffn_dim_multiplier=1.3, max_seq_len=8192, rope_theta=500000.0)


def deepseek_v3_class():
    """DeepSeek-V3's sizes (61 layers, 3 dense, 256 routed experts top-8 + 1 shared, 7168 wide) with GQA in
    place of MLA: 672 B parameters."""
    return ModelArgs(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280, multiple_of=256,
                     max_seq_len=4096, n_dense_layers=3,
                     moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=2048, n_shared_experts=1, score_func="sigmoid",
                                 route_norm=True, n_groups=8, topk_groups=4))


# ------------------------------------------------------------------ Cluster

def test_cluster_memory_strings_and_presets():
    assert Cluster(8, 8, "80GiB").device_memory == 80 * GiB
    assert Cluster(8, 8, "80GB").device_memory == 80 * 10**9
    assert Cluster(8, 8, 1234).device_memory == 1234
    assert Cluster(8, 8, "512 MiB").device_memory == 512 * 2**20
    h = Cluster.preset("h100", 16)
    assert h.world_size == 16 and h.devices_per_node == 8 and h.device_memory == 80 * GiB
    assert h.peak_flops == 989e12 and h.flops == pytest.approx(989e12 * 0.70) and h.intra_node_bw > h.inter_node_bw
    assert h.attention_flops < h.flops and h.hbm_bw > 0
    with pytest.raises(ValueError, match="device_memory='80 parsecs'"):
        Cluster(8, 8, "80 parsecs")
    with pytest.raises(ValueError, match="world_size"):
        Cluster(0, 8, "80GiB")
    with pytest.raises(ValueError, match="unknown name 'tpu'"):
        Cluster.preset("tpu", 8)


def test_collective_time_alpha_beta():
    c = Cluster(16, 8, "80GiB", intra_node_bw=100e9, inter_node_bw=10e9, latency=1e-5)
    # ring all_gather over 4 ranks in a node: 3 steps, 3/4 of the buffer per rank
    assert c.collective_time("all_gather", 4e9, 4, True) == pytest.approx(3e-5 + 0.75 * 4e9 / 100e9)
    assert c.collective_time("all_reduce", 4e9, 4, False) == pytest.approx(6e-5 + 1.5 * 4e9 / 10e9)
    assert c.collective_time("all_reduce", 4e9, 1, False) == 0.0


# ------------------------------------------------------------------ roles

def test_roles_of_example_llama_and_moe():
    for name in ("tiny", "moe-tiny"):
        cfg = get_config(name)
        m = _meta(cfg.model)
        info = infer_roles(m, trace_model(m, cfg.seq_len))
        r = info.module_roles
        assert r["tok_embeddings"] == "embedding" and r["output"] == "output" and r["norm"] == "norm"
        assert [r[f"layers.0.attention.w{k}"] for k in "qkvo"] == ["attention_q", "attention_k", "attention_v",
                                                                    "attention_o"]
        assert [r[f"layers.0.feed_forward.w{k}"] for k in "132"] == ["mlp_gate", "mlp_up", "mlp_down"]
        assert (info.n_heads, info.n_kv_heads, info.head_dim) == (4, 2, 16)
        if name == "moe-tiny":
            assert r["layers.1.moe.experts"] == "experts" and r["layers.1.moe.router.gate"] == "router"
            assert r["layers.1.moe.shared_experts.w2"] == "mlp_down"
            assert (info.num_experts, info.top_k) == (8, 2) and info.block_is_moe == [False, True, True]


def test_roles_under_other_names():
    m = Renamed()
    info = infer_roles(m, trace_model(m, 16))
    r = info.module_roles
    assert r["wte"] == "embedding" and r["lm_head"] == "output" and r["ln_f"] == "norm"
    assert r["h.1.self_attn.q_proj"] == "attention_q" and r["h.1.self_attn.out_proj"] == "attention_o"
    assert r["h.2.mlp.gate_proj"] == "mlp_gate" and r["h.2.mlp.up_proj"] == "mlp_up"
    assert r["h.2.mlp.down_proj"] == "mlp_down" and r["h.0.ln_1"] == "norm" and r["h.0.ln_2"] == "norm"
    assert info.block_names == ["h.0", "h.1", "h.2"]


def test_unknown_module_kind_names_the_module_and_roles_override():
    m = Renamed(conv=True)
    with pytest.raises(ValueError, match=r"'h.0.conv' \(Conv1d.*roles=\{'h.0.conv': ROLE\}"):
        plan(m, Cluster(4, 4, "1GiB"), global_batch=8, seq_len=16)
    roles = {f"h.{i}.conv": "replicate" for i in range(3)}
    best = plan(m, Cluster(4, 4, "1GiB"), global_batch=8, seq_len=16, roles=roles)[0]
    assert sum(best.degrees[k] for k in ("dp", "fsdp", "tp", "pp", "cp")) >= 1
    with pytest.raises(ValueError, match="unknown role 'conv'"):
        plan(m, Cluster(4, 4, "1GiB"), global_batch=8, seq_len=16, roles={"h.0.conv": "conv"})


# ------------------------------------------------------------------ search

def _check_plan(p, world):
    assert set(p.degrees) == {"dp", "fsdp", "tp", "pp", "cp", "ep"}
    d = p.degrees
    assert d["dp"] * d["fsdp"] * d["tp"] * d["pp"] * d["cp"] == world
    assert isinstance(p.sequence_parallel, bool) and isinstance(p.activation_checkpointing, str)
    m = p.memory
    assert m.total == m.params + m.grads + m.optimizer + m.activations + m.buffers
    t = p.step_time
    assert t.total == pytest.approx(t.compute + t.comm + t.bubble) and t.total > 0


def test_plan_contract_on_demo_configs():
    for name in ("demo", "moe-demo", "long"):
        cfg = get_config(name)
        ps = plan(_meta(cfg.model), Cluster(8, 4, "2GiB"), global_batch=cfg.global_batch, seq_len=cfg.seq_len, top_k=5)
        assert 1 <= len(ps) <= 5
        times = [p.step_time.total for p in ps]
        assert times == sorted(times)
        for p in ps:
            _check_plan(p, 8)
            assert p.memory.total <= 2 * GiB
            assert "TOTAL" in p.explain() and p.to_args()
        assert "rejected" in explain_rejections()


def test_parallelisms_restrict_the_search():
    cfg = get_config("demo")
    m = _meta(cfg.model)
    ps = plan(m, Cluster(4, 4, "2GiB"), global_batch=16, seq_len=128, parallelisms=("fsdp",))
    assert ps and all(p.degrees == dict(dp=1, fsdp=4, tp=1, pp=1, cp=1, ep=1) for p in ps)
    assert {p.activation_checkpointing for p in ps} == {"none", "full", "selective"}
    ps = plan(m, Cluster(4, 4, "2GiB"), global_batch=16, seq_len=128, parallelisms=("tp", "sp"))
    assert all(p.degrees["tp"] == 4 for p in ps) and any(p.sequence_parallel for p in ps)


def test_impossible_constraint_says_why():
    cfg = get_config("tiny")  # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match=r"tp=8 does not divide n_heads \(4\)"):
        plan(_meta(cfg.model), Cluster(8, 8, "1GiB"), global_batch=8, seq_len=32, parallelisms=("tp",))
    with pytest.raises(ValueError, match="global_batch=3 is not divisible by dp\\*fsdp=2"):
        evaluate_plan(_meta(cfg.model), Cluster(2, 2, "1GiB"), degrees={"fsdp": 2}, global_batch=3, seq_len=32)


def test_nothing_fits_names_smallest_memory_in_gib():
    cfg = get_config("demo")
    with pytest.raises(ValueError, match=r"smallest per-rank memory needed is [0-9.]+ GiB.*closest to fitting: "):
        plan(_meta(cfg.model), Cluster(2, 2, "1MiB"), global_batch=16, seq_len=128)


def test_activation_checkpointing_and_sp_lower_activations():
    cfg = get_config("demo")
    m = _meta(cfg.model)
    c = Cluster(4, 4, "2GiB")
    kw = dict(global_batch=16, seq_len=128)
    none = evaluate_plan(m, c, degrees={"fsdp": 2, "tp": 2}, **kw)
    sp = evaluate_plan(m, c, degrees={"fsdp": 2, "tp": 2}, sequence_parallel=True, **kw)
    ac = evaluate_plan(m, c, degrees={"fsdp": 2, "tp": 2}, activation_checkpointing="full", **kw)
    assert sp.memory.activations < none.memory.activations and ac.memory.activations < none.memory.activations
    assert ac.step_time.compute > none.step_time.compute
    assert none.memory.state == sp.memory.state == ac.memory.state


@pytest.mark.parametrize("which", ["llama-70b", "deepseek-v3-class"])
def test_plan_speed_at_world_1024(which):
    args, gb, s = (llama_70b(), 1024, 8192) if which == "llama-70b" else (deepseek_v3_class(), 4096, 4096)
    m = _meta(args)
    t0 = time.perf_counter()
    ps = plan(m, Cluster(1024, 8, "80GiB"), global_batch=gb, seq_len=s, param_dtype=torch.bfloat16,
              reduce_dtype=torch.float32)
    took = time.perf_counter() - t0
    assert took < 10 * 3, took  # 10 s on a quiet machine (benchmarks/bench_auto_parallel.py); slack for CI load
    for p in ps:
        _check_plan(p, 1024)
        assert p.memory.total <= 80 * GiB
    if which == "deepseek-v3-class":
        assert ps[0].degrees["ep"] > 1


def test_command_line_prints_top_plans():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "hyper_parallel.auto", "--config", "moe-demo", "--world", "64",
                          "--devices-per-node", "8", "--device-memory", "80GiB", "--top-k", "2", "--rejections", "2"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("plan: ") == 2 and "args: " in out.stdout and "candidates rejected" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "hyper_parallel.auto", "--config", "nope", "--world", "8"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "unknown config 'nope'" in bad.stderr
