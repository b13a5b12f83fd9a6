"""Deterministic (input, target) batches from the byte-tokenized example corpus.

Why it is built this way: distributed training is checked against a
single-process reference, so the batch for a global step must be a pure
function of (seed, step, global_batch_size, seq_len) -- identical in every
process, independent of how many batches were drawn before, and sliced into
data-parallel shards afterwards (``dp_shard``) exactly as ``Shard(0)`` of the
global batch would be.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from examples.llama.tokenizer import ByteTokenizer

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def load_corpus_tokens(data_dir: Union[str, Path] = DATA_DIR, tokenizer: Optional[ByteTokenizer] = None) -> torch.Tensor:
    """Every ``*.txt`` in ``data_dir`` (sorted by name), each as <bos> text <eos>, as one int64 tensor."""
    tok = tokenizer or ByteTokenizer()
    files = sorted(Path(data_dir).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt corpus files in {data_dir}")
    return torch.cat([tok.encode_tensor(f.read_text(encoding="utf-8"), bos=True, eos=True) for f in files])


class TokenBatches:
    """Random windows of a token stream; batch ``step`` depends only on (seed, step, sizes).

    ``split`` keeps the last ``val_fraction`` of the tokens apart for evaluation
    ("val") from the rest ("train"); windows never cross the boundary.
    """

    def __init__(self, tokens: Optional[torch.Tensor] = None, seed: int = 0, split: str = "train",
                 val_fraction: float = 0.05):
        tokens = load_corpus_tokens() if tokens is None else tokens
        cut = int(len(tokens) * (1.0 - val_fraction))
        if split == "train":
            self.tokens = tokens[:cut]
        elif split == "val":
            self.tokens = tokens[cut:]
        else:
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        self.seed = seed
        # Keep different splits on different random streams even for the same seed.
        self._stream = 0 if split == "train" else 1

    def __len__(self) -> int:
        return len(self.tokens)

    def get_batch(self, step: int, global_batch_size: int, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: x, y int64 [global_batch_size, seq_len], y = x shifted by one."""
        n_starts = len(self.tokens) - seq_len  # start s needs tokens[s : s + seq_len + 1]
        if n_starts <= 0:
            raise ValueError(f"seq_len={seq_len} too long for {len(self.tokens)} tokens")
        gen = torch.Generator().manual_seed(_mix(self.seed, self._stream, step))
        starts = torch.randint(0, n_starts, (global_batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]  # [B, S+1]
        windows = self.tokens[idx]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def dp_shard(batch: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Rows of ``batch`` for data-parallel rank ``dp_rank`` of ``dp_size``: the contiguous
    block ``[r*B/n, (r+1)*B/n)``, i.e. what ``Shard(0)`` gives that rank. B must divide evenly,
    so that the mean of the per-rank mean losses equals the global mean loss."""
    b = batch.shape[0]
    if b % dp_size:
        raise ValueError(f"global batch {b} is not divisible by dp size {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp size {dp_size}")
    per = b // dp_size
    return batch[dp_rank * per:(dp_rank + 1) * per]


def _mix(seed: int, stream: int, step: int) -> int:
    """Generator seed for (seed, stream, step). CPU generators keep only 32 bits of a seed,
    so hash (seed, stream) to a 32-bit base and add ``step``: steps of one run never collide."""
    z = (seed * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64  # splitmix64 finaliser
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return ((z ^ (z >> 31)) + step) & 0xFFFFFFFF


_M64 = (1 << 64) - 1
