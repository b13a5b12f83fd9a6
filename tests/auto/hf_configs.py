"""Hugging Face transformers configs for the planner tests, built in code (no download): the published
``config.json`` sizes of Llama-3-8B/70B, Qwen3-8B, Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3, and tiny
versions of the same architectures. ``meta_model(name)`` builds the model on the meta device.

``python tests/auto/hf_configs.py`` times ``plan()`` on every real-size config at world 256.
"""
import time

import torch

# the published config.json values (model card repositories on the Hugging Face hub)
REAL = {
    "llama3-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)),
    "llama3-70b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)),
    "qwen3-8b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                     head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                     rope_theta=1000000.0, tie_word_embeddings=False)),
    "mixtral-8x7b": ("MixtralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                           num_local_experts=8, num_experts_per_tok=2,
                                           max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                             moe_intermediate_size=768, num_hidden_layers=48,
                                             num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                             num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                                             mlp_only_layers=[], norm_topk_prob=True,
                                             max_position_embeddings=40960, rms_norm_eps=1e-6,
                                             rope_theta=1000000.0, tie_word_embeddings=False)),
    "deepseek-v3": ("DeepseekV3Config", dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                                             moe_intermediate_size=2048, num_hidden_layers=61,
                                             num_attention_heads=128, num_key_value_heads=128,
                                             n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                                             first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
                                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                             n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                             norm_topk_prob=True, max_position_embeddings=163840,
                                             rms_norm_eps=1e-6, tie_word_embeddings=False)),
}

_TINY_COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256)
TINY = {
    "llama": ("LlamaConfig", dict(_TINY_COMMON, intermediate_size=96, num_hidden_layers=2)),
    "qwen3": ("Qwen3Config", dict(_TINY_COMMON, intermediate_size=96, num_hidden_layers=2, head_dim=16)),
    "mixtral": ("MixtralConfig", dict(_TINY_COMMON, intermediate_size=96, num_hidden_layers=2, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(_TINY_COMMON, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    "deepseek-v3": ("DeepseekV3Config", dict(_TINY_COMMON, num_key_value_heads=4, intermediate_size=96,
                                             moe_intermediate_size=32, num_hidden_layers=3, n_routed_experts=8,
                                             n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                             q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                                             qk_rope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1)),
}


def config(name: str, tiny: bool = False):
    import transformers
    cls, kwargs = (TINY if tiny else REAL)[name]
    return getattr(transformers, cls)(**kwargs)


def build(name: str, tiny: bool = False, device: str = "meta", dtype=torch.bfloat16):
    """The ``*ForCausalLM`` model of config ``name`` (``tiny``: the small version) on ``device``."""
    from transformers import AutoModelForCausalLM
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config(name, tiny), dtype=dtype)


def main():
    from hyper_parallel.auto import Cluster, plan
    for name in REAL:
        model = build(name)
        t0 = time.perf_counter()
        plans = plan(model, Cluster.preset("h100", 256), global_batch=512, seq_len=4096, top_k=10**6)
        took = time.perf_counter() - t0
        info = plans[0]._model_info
        n_ep = sum(1 for p in plans if p.degrees["ep"] > 1)
        print(f"{name:14s} plan() {took:5.2f} s  {sum(p.numel() for p in model.parameters()) / 1e9:6.1f} B params  "
              f"experts {info.num_experts:3d} top-{info.top_k}  fitting plans {len(plans):5d} (ep > 1: {n_ep:4d})  "
              f"top: {plans[0].summary()}")


if __name__ == "__main__":
    main()
