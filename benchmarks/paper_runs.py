"""Published training runs the planner is checked against (``bench_auto_parallel.py paper``).

* Megatron-LM, Narayanan et al. 2021 (arXiv 2104.04473), Table 1: GPT models (learned positions, LayerNorm,
  GELU MLP of 4h, multi-head attention), vocabulary 51200, sequence 2048, A100 80GB (312 TFLOP/s peak), 8 per
  node, full activation recomputation, data parallelism by replication (no optimizer sharding). The paper
  counts ``F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` FLOPs per step (the recomputed forward included).
* Llama 3 (2024), Table 4: 405B on H100 80GB (989 TFLOP/s dense bf16), 16M tokens per batch, TP 8, PP 16,
  DP 64 / 128 at 8K, and TP 8, CP 16, PP 16, DP 8 at 128K. Its TFLOP/s are its BF16 MFU of 989 TFLOP/s, with
  model FLOPs counted by PaLM's MFU convention (``6 N`` per token plus attention without the causal discount,
  ``llama3_flops``). It trained the 8K runs without activation checkpointing
  and sharded the optimizer state over the data-parallel ranks.

The models are written here (not the example's Llama) so that the planner reads a model it was not written
for: other module names, a bias in every Linear, LayerNorm, a learned position table.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class GPTAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, x.shape[-1] // self.heads).transpose(1, 2)
                   for f in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, s, -1))


class GPTMLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class GPTLayer(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = GPTAttention(hidden, heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = GPTMLP(hidden)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class GPT(nn.Module):
    """Megatron's GPT: word + learned position embeddings, pre-LayerNorm blocks, final LayerNorm, untied head."""

    def __init__(self, hidden: int, heads: int, layers: int, vocab: int = 51200, seq: int = 2048):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleDict({str(i): GPTLayer(hidden, heads) for i in range(layers)})
        self.final_layernorm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.word_embeddings(tokens) + self.position_embeddings(pos)
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.final_layernorm(h))


# params (B), heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU
MEGATRON_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# Table 2 (the same paper): PTD-P (TP 8 x PP 12 / 35, interleaved, microbatch 1) against ZeRO-3 without model
# parallelism (here: fsdp over every GPU), full recompute. params (B), heads, hidden, layers, PP, GPUs, batch,
# TFLOP/s per GPU of PTD-P, of ZeRO-3 (None: that row has another batch)
MEGATRON_TABLE2 = [
    (174.6, 96, 12288, 96, 12, 384, 1536, 153, 144), (174.6, 96, 12288, 96, 12, 768, 1536, 149, 88),
    (174.6, 96, 12288, 96, 12, 1536, 1536, 141, 44), (529.6, 128, 20480, 105, 35, 560, 2240, 171, None),
    (529.6, 128, 20480, 105, 35, 1120, 2240, 167, 98), (529.6, 128, 20480, 105, 35, 2240, 2240, 159, 48),
]
# GPUs, TP, CP, PP, DP, seq, TFLOP/s per GPU
LLAMA3_TABLE4 = [(8192, 8, 1, 16, 64, 8192, 430), (16384, 8, 1, 16, 128, 8192, 400),
                 (16384, 8, 16, 16, 8, 131072, 380)]
LLAMA3_TOKENS = 16 * 2**20


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int = 51200) -> float:
    """FLOPs of one step as the paper counts them (forward, backward and the recomputed forward)."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def llama3_flops(tokens: int, seq: int, n_params: float, layers: int = 126, dim: int = 16384,
                 vocab: int = 128256) -> float:
    """FLOPs of one step as Llama 3 reports them: its TFLOP/s per GPU are its BF16 MFU times the H100's 989
    TFLOP/s (430 = 43.5%, 400 = 40.4%, 380 = 38.4%), and MFU follows PaLM's definition (Chowdhery et al. 2022,
    appendix B), the convention Meta's torchtitan also uses (``get_nparams_and_flops``): 6 x the non-embedding
    parameters per token plus 12 x layers x seq x dim for attention, *not* discounting the causal mask ("we
    follow the convention and do not account for sparsity in causal attention"). The cost model itself
    counts the causal mask (half the attention matmuls); only this published-figure conversion does not."""
    return tokens * (6 * (n_params - vocab * dim) + 12 * layers * seq * dim)


def llama_405b(seq: int):
    from examples.llama.model import ModelArgs, Transformer
    args = ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                     ffn_dim_multiplier=1.2, max_seq_len=seq, rope_theta=500000.0)
    with torch.device("meta"):
        m = Transformer(args, init_seed=None)
    return m


def gpt(hidden: int, heads: int, layers: int):
    with torch.device("meta"):
        return GPT(hidden, heads, layers)


def n_params(model) -> float:
    return float(sum(p.numel() for p in model.parameters()))


def check_llama_ffn(model) -> int:
    return model.layers["0"].feed_forward.w1.weight.shape[0]


assert math.isclose(megatron_flops(1, 1, 1, 1, 0), 96 * (1 + 1 / 6))
