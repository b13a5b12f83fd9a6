"""Models for the planner tests: the example Llama's module kinds under other names (and one unknown kind)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttn(nn.Module):
    def __init__(self, d, heads, kv):
        super().__init__()
        self.hd = d // heads
        self.q_proj = nn.Linear(d, heads * self.hd, bias=False)
        self.k_proj = nn.Linear(d, kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kv * self.hd, bias=False)
        self.out_proj = nn.Linear(heads * self.hd, d, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.hd).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(o.transpose(1, 2).reshape(b, s, -1))


class GatedMLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, d, heads, kv, h, conv=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.self_attn = SelfAttn(d, heads, kv)
        self.ln_2 = nn.RMSNorm(d)
        self.mlp = GatedMLP(d, h)
        self.conv = nn.Conv1d(d, d, 1) if conv else None

    def forward(self, x):
        x = x + self.self_attn(self.ln_1(x))
        if self.conv is not None:
            x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        return x + self.mlp(self.ln_2(x))


class Renamed(nn.Module):
    """Embedding -> blocks (LayerNorm, attention, RMSNorm, gated MLP) -> norm -> head, all under other names."""

    def __init__(self, vocab=96, d=32, heads=4, kv=2, h=64, n=3, conv=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList([Layer(d, heads, kv, h, conv) for _ in range(n)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.wte(tokens)
        for layer in self.h:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


def build_renamed(seed=0, **kw):
    torch.manual_seed(seed)
    return Renamed(**kw)
