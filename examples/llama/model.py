"""A small Llama-style decoder in plain PyTorch, laid out for torchtitan-style tensor parallelism.

Why it looks the way it does:

* Module names follow torchtitan (``tok_embeddings``, ``layers.<i>.attention.wq`` ...,
  ``feed_forward.w1/w2/w3``, ``norm``, ``output``) so a torchtitan-like TP plan
  (colwise ``wq/wk/wv/w1/w3``, rowwise ``wo/w2``, rowwise ``tok_embeddings``,
  colwise ``output``) applies by fully-qualified name.
* ``Attention.forward`` derives the number of (local) heads from tensor shapes
  (``view(bs, seqlen, -1, head_dim)``), never from ``ModelArgs``, so the same code
  runs on a full module and on one whose projections were sharded by heads.
* Everything is real-valued: rotary embeddings use precomputed cos/sin buffers
  and the rotate-half formulation (chunk/cat/mul/add), no complex tensors.
* ``init_weights(seed)`` draws from a private ``torch.Generator``, so every
  process that builds the model gets bit-identical weights without touching the
  global RNG.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.llama.moe import MoE, MoEArgs


@dataclass
class ModelArgs:
    """Hyperparameters of the decoder (names follow torchtitan's ``ModelArgs``)."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None: same as n_heads (no grouped-query attention)
    vocab_size: int = 260
    multiple_of: int = 32  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    # Mixture of experts (examples/llama/moe.py): None keeps every block dense. With it, blocks
    # n_dense_layers.. have an MoE feed-forward (``layers.<i>.moe``) instead of ``feed_forward``.
    moe: Optional[MoEArgs] = None
    n_dense_layers: int = 1
    # Dropout (GPT-2 style) on the embeddings, on each residual branch and on the attention weights;
    # 0 (default) adds no op. Draws come from torch's generator (train.py seeds it and checkpoints it).
    dropout: float = 0.0

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Llama's SwiGLU width: 2/3 of 4*dim, optionally scaled, rounded up to ``multiple_of``."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# --------------------------------------------------------------------------- rotary embeddings


def precompute_rope(head_dim: int, max_seq_len: int, theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Real cos/sin tables of shape [max_seq_len, head_dim] for the rotate-half formulation.

    Frequency i (of head_dim/2) is used for both halves of the head, so that
    ``x * cos + rotate_half(x) * sin`` rotates the pair (x[i], x[i + head_dim/2]).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # [S, hd/2]
    angles = torch.cat((angles, angles), dim=-1)  # [S, hd]
    return angles.cos().float(), angles.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] along the last dim (which tensor parallelism never shards)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [bs, seqlen, heads, head_dim] by position; cos/sin are [seqlen, head_dim]."""
    cos = cos.view(1, x.shape[1], 1, x.shape[-1])
    sin = sin.view(1, x.shape[1], 1, x.shape[-1])
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """RMSNorm via ``F.rms_norm`` so that a distributed-tensor library sees one op."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)

    def reset_parameters(self):
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Causal grouped-query self-attention; head counts come from shapes (TP-friendly)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.dropout = args.dropout
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1: the heads this rank holds (all of them without TP, n_heads/tp with it).
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rope(xq, cos, sin), apply_rope(xk, cos, sin)

        n_rep = xq.shape[2] // xk.shape[2]  # query heads per kv head, from the actual shapes
        if n_rep > 1:
            xk = xk.repeat_interleave(n_rep, dim=2)
            xv = xv.repeat_interleave(n_rep, dim=2)

        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)  # [bs, heads, seqlen, hd]
        if self.dropout and self.training:  # attention dropout (torch's kernel draws the mask)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        hidden = args.ffn_hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: h = x + attn(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        self.dropout = args.dropout
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.moe is not None and layer_id >= args.n_dense_layers:
            self.moe = MoE(args.dim, args.moe)  # torchtitan's name: layers.<i>.moe.{router,experts,...}
        else:
            self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        if self.dropout:  # residual dropout on each branch
            h = x + F.dropout(self.attention(self.attention_norm(x), cos, sin), self.dropout, self.training)
            return h + F.dropout(ffn(self.ffn_norm(h)), self.dropout, self.training)
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids [B, S] -> logits [B, S, vocab_size].

    Built with ``init_seed`` (default 0), the weights are a pure function of
    (args, init_seed). Pass ``init_seed=None`` to skip initialisation (e.g. when
    building on the meta device; call ``init_weights`` later).
    """

    def __init__(self, args: ModelArgs, init_seed: Optional[int] = 0):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight  # one Parameter, both [vocab, dim]
        # Non-persistent: derived data, kept out of state_dict (and so out of checkpoints/comparisons).
        cos, sin = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if init_seed is not None:
            self.init_weights(init_seed)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init from a private generator, in a fixed module order.

        Linear/embedding weights: truncated normal, std 0.02; the residual-output
        projections (``wo``, ``w2``) use 0.02 / sqrt(2 * n_layers) (GPT-2 style);
        an untied ``output`` uses dim**-0.5. Norm weights are ones.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = 0.02
        out_std = std / math.sqrt(2 * self.args.n_layers)
        # Draw on CPU then copy, so the numbers do not depend on the parameters' device.
        self._fill(self.tok_embeddings.weight, gen, std)
        for i in range(self.args.n_layers):
            layer = self.layers[str(i)]
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
            attn = ((layer.attention.wq, std), (layer.attention.wk, std), (layer.attention.wv, std),
                    (layer.attention.wo, out_std))
            if hasattr(layer, "moe"):  # MoE block: attention, then the MoE layer's own fixed order
                for lin, s in attn:
                    self._fill(lin.weight, gen, s)
                layer.moe.init_weights(gen, self._fill, std, out_std)
                continue
            for lin, s in attn + ((layer.feed_forward.w1, std), (layer.feed_forward.w3, std),
                                  (layer.feed_forward.w2, out_std)):
                self._fill(lin.weight, gen, s)
        self.norm.reset_parameters()
        if not self.args.tie_embeddings:
            self._fill(self.output.weight, gen, self.args.dim ** -0.5)
        cos, sin = precompute_rope(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        self.rope_cos = cos.to(self.rope_cos.device)
        self.rope_sin = sin.to(self.rope_sin.device)

    @staticmethod
    def _fill(param: torch.Tensor, gen: torch.Generator, std: float) -> None:
        w = torch.empty(param.shape, dtype=torch.float32)
        nn.init.trunc_normal_(w, 0.0, std, -3 * std, 3 * std, generator=gen)
        param.copy_(w)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids -> logits. A pipeline stage (``hyper_parallel.pipelining.split_into_stages``) has
        some of ``tok_embeddings`` / blocks / ``norm`` / ``output`` deleted (``None``): it takes and
        returns hidden states [B, S, dim] where its missing parts would be."""
        seqlen = tokens.shape[1]
        if seqlen > self.args.max_seq_len:
            raise ValueError(f"sequence length {seqlen} > max_seq_len {self.args.max_seq_len}")
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.args.dropout and self.tok_embeddings is not None:  # embedding dropout
            h = F.dropout(h, self.args.dropout, self.training)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def num_params(self) -> int:
        """Distinct parameters (a tied embedding is counted once)."""
        return sum(p.numel() for p in self.parameters())


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all B*S positions."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def build_model(args: ModelArgs, seed: int = 0) -> Transformer:
    """The model every process builds identically: ``Transformer(args)`` initialised from ``seed``."""
    return Transformer(args, init_seed=seed)
