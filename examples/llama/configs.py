"""Named model + training configurations for the example (tiny for tests, demo for a CPU run).

Why here: the single-process reference and the parallel script must train the
same model on the same batches with the same optimizer settings; one place
defines them. Limits for tensor parallelism: the TP degree must divide
``n_kv_heads`` (heads are sharded whole), ``ffn_hidden_dim`` and ``vocab_size``.
``vocab_size`` is the tokenizer's 259 padded to 260 (divisible by 2 and 4).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Tuple

from examples.llama.model import ModelArgs
from examples.llama.moe import MoEArgs


@dataclass
class OptimConfig:
    """AdamW + global-norm clipping, fixed so that reference and parallel runs agree."""

    lr: float = 3e-3
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0


@dataclass
class TrainConfig:
    model: ModelArgs
    seq_len: int
    global_batch: int  # divisible by every dp size you intend to use
    steps: int
    seed: int = 0  # model init and data order
    optim: OptimConfig = field(default_factory=OptimConfig)


# Unit tests: ~0.1 M parameters, a few ms per step. TP <= 2 (2 kv heads), dp <= 8.
TINY = TrainConfig(
    model=ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=260, multiple_of=32,
                    max_seq_len=32, tie_embeddings=False),
    seq_len=32, global_batch=8, steps=20,
)

# CPU demo (4 processes on 2 cores, e.g. dp=2 x tp=2): ~0.9 M parameters. TP <= 4 (4 kv heads).
DEMO = TrainConfig(
    model=ModelArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=260, multiple_of=64,
                    max_seq_len=128, tie_embeddings=False),
    seq_len=128, global_batch=16, steps=60,
)

# Mixture of experts (examples/llama/moe.py): block 0 dense, the others MoE. Expert parallelism:
# --ep must divide num_experts. moe-tiny (tests): 8 experts, top-2, 1 shared, softmax scores,
# aux-loss-free balancing; ~0.22 M parameters.
MOE_TINY = TrainConfig(
    model=ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=260, multiple_of=32,
                    max_seq_len=32, tie_embeddings=False, n_dense_layers=1,
                    moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, n_shared_experts=1, score_func="softmax",
                                load_balance_coeff=1e-3)),
    seq_len=32, global_batch=8, steps=20,
)

# MoE CPU demo, DeepSeek-V3 style routing: 16 experts in 4 groups, a token routes into its best 2
# groups; sigmoid scores normalised over the top-2; a faster bias step (1e-2) and the sequence-wise aux loss
# (1e-2) so that short runs rebalance; ~1.7 M parameters.
MOE_DEMO = TrainConfig(
    model=ModelArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=260, multiple_of=64,
                    max_seq_len=128, tie_embeddings=False, n_dense_layers=1,
                    moe=MoEArgs(num_experts=16, top_k=2, hidden_dim=64, n_shared_experts=1, score_func="sigmoid",
                                route_norm=True, n_groups=4, topk_groups=2, load_balance_coeff=1e-2,
                                aux_loss_coeff=1e-2)),
    seq_len=128, global_batch=16, steps=60,
)

# --- CP: a longer sequence for context parallelism (train.py --cp N): 1024 tokens, ~0.13 M parameters.
# 8 query / 4 kv heads: Ulysses up to cp 8 (tp x cp <= 8 query heads), ring/hybrid any cp; 1024 = 2 x cp x 128.
LONG = TrainConfig(
    model=ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=260, multiple_of=32,
                    max_seq_len=1024, tie_embeddings=False),
    seq_len=1024, global_batch=4, steps=30,
)
# --- end CP

CONFIGS = {"tiny": TINY, "demo": DEMO, "moe-tiny": MOE_TINY, "moe-demo": MOE_DEMO, "long": LONG}


def get_config(name: str, **overrides) -> TrainConfig:
    """A copy of the named config; keyword overrides replace TrainConfig fields (e.g. steps=10)."""
    try:
        cfg = CONFIGS[name]
    except KeyError:
        raise KeyError(f"unknown config {name!r}; choose from {sorted(CONFIGS)}") from None
    moe = replace(cfg.model.moe) if cfg.model.moe is not None else None
    return replace(cfg, model=replace(cfg.model, moe=moe), optim=replace(cfg.optim), **overrides)
