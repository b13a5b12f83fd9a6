"""Seeded random blocks: a fresh CPU generator per (seed) draw, so values depend on the seed alone.

The DTensor random stream (``hyper_parallel/dtensor/random.py``) cuts a global tensor into
blocks and draws each block from its own seed; drawing on the CPU generator and then moving
makes the values the same on every device type.
"""
from __future__ import annotations

import torch


def seeded_random(kind: str, shape, seed: int, dtype=None, device=None):
    """Random tensor of ``shape`` from a fresh generator seeded with ``seed`` (CPU generator, then moved)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    dtype = dtype or torch.get_default_dtype()
    if kind == "rand":
        out = torch.rand(shape, generator=gen, dtype=dtype)
    elif kind == "randn":
        out = torch.randn(shape, generator=gen, dtype=dtype)
    else:
        raise ValueError(f"seeded_random: kind must be 'rand' or 'randn', got {kind!r}")
    return out if device is None or torch.device(device).type == "cpu" else out.to(device)


def narrow_block(tensor, offsets, sizes):
    """The block of ``tensor`` at ``offsets`` with ``sizes`` (contiguous)."""
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        if o != 0 or s != tensor.shape[d]:
            tensor = tensor.narrow(d, o, s)
    return tensor.contiguous()
