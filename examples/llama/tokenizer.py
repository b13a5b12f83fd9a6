"""Byte-level tokenizer: ids 0..255 are raw UTF-8 bytes, then a few special tokens.

Why bytes: no vocabulary file to ship or download, every string round-trips
exactly, and the vocabulary is tiny (fits a small demo model).
"""
from __future__ import annotations

from typing import Iterable, List

import torch


class ByteTokenizer:
    """UTF-8 bytes plus ``<bos>`` (256), ``<eos>`` (257), ``<pad>`` (258)."""

    NUM_BYTES = 256
    SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")

    def __init__(self):
        self.special_ids = {name: self.NUM_BYTES + i for i, name in enumerate(self.SPECIAL_TOKENS)}
        self.bos_id = self.special_ids["<bos>"]
        self.eos_id = self.special_ids["<eos>"]
        self.pad_id = self.special_ids["<pad>"]

    @property
    def vocab_size(self) -> int:
        """259: bytes plus specials. Models may use a larger (padded) embedding table."""
        return self.NUM_BYTES + len(self.SPECIAL_TOKENS)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> List[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_tensor(self, text: str, bos: bool = False, eos: bool = False) -> torch.Tensor:
        """Like ``encode`` but straight to an int64 tensor (fast for a whole corpus)."""
        raw = bytearray(text.encode("utf-8"))
        body = torch.frombuffer(raw, dtype=torch.uint8).to(torch.int64) if raw else torch.empty(0, dtype=torch.int64)
        parts = ([torch.tensor([self.bos_id])] if bos else []) + [body] + ([torch.tensor([self.eos_id])] if eos else [])
        return torch.cat(parts)

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; special (and out-of-range) ids are dropped, bad UTF-8 is replaced."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < self.NUM_BYTES)
        return data.decode("utf-8", errors="replace")
