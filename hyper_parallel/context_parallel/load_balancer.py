"""torch 2.13's context-parallel load balancers (``torch.distributed.tensor.experimental._context_parallel.
_load_balancer``), same signatures and the same reorder indices.

A load balancer says how the sequence is reordered before it is cut into ``cp`` equal chunks:
``_generate_indices(restore=False)`` returns ``(1, S)`` (or ``(B, S)``) indices with
``reordered = x[..., idx, ...]``; ``restore=True`` the inverse permutation. ``_context_parallel_shard``
(:mod:`.torch_private`) records these indices as the shards' :class:`~.order.SequenceOrder`, so the
attention is exact for every balancer here and for any user subclass returning a permutation.

Difference from torch: ``_HeadTailLoadBalancer`` also accepts lengths not divisible by ``2 * cp``
(torch asserts): it then uses hyper_parallel's uneven head-tail chunks (``plan.zigzag_chunk_sizes``),
whose order is recorded like any other.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from hyper_parallel.context_parallel.plan import zigzag_chunk_sizes


class _LoadBalancer(ABC):
    """torch's ``_LoadBalancer``: ``_generate_indices(restore=False)`` -> ``(1|B, seq_len)`` indices."""

    @abstractmethod
    def _generate_indices(self, restore: bool = False):
        ...


def _restore(idx):
    return torch.argsort(idx, dim=-1)


class _HeadTailLoadBalancer(_LoadBalancer):
    """Rank ``r`` gets chunks ``r`` and ``2 * world_size - 1 - r`` of ``2 * world_size`` (torch's order)."""

    def __init__(self, seq_length: int, world_size: int, device):
        self.seq_length = seq_length
        self.world_size = world_size
        self.device = device

    def _generate_indices(self, restore: bool = False):
        S, n = self.seq_length, self.world_size
        if not isinstance(S, int) or not isinstance(n, int) or n < 1 or S < n:
            raise ValueError(f"_HeadTailLoadBalancer: needs seq_length >= world_size >= 1, got seq_length={S!r}, "
                             f"world_size={n!r}")
        sizes = zigzag_chunk_sizes(S, n)       # = S // (2n) each when divisible (torch's chunks)
        starts = [0]
        for c in sizes[:-1]:
            starts.append(starts[-1] + c)
        idx = []
        for r in range(n):
            for c in (r, 2 * n - 1 - r):
                idx.extend(range(starts[c], starts[c] + sizes[c]))
        out = torch.tensor(idx, dtype=torch.int, device=self.device)
        if restore:
            out = _restore(out)
        return out.unsqueeze(0)


class _PerDocumentHeadTailLoadBalancer(_LoadBalancer):
    """Head-tail within every document (``seq_length_per_doc``: per batch row, the document lengths)."""

    def __init__(self, seq_length_per_doc, world_size: int, device):
        self.seq_length_per_doc = seq_length_per_doc
        self.world_size = world_size
        self.device = device

    def _generate_indices(self, restore: bool = False):
        return torch.stack([self._row(lens, restore) for lens in self.seq_length_per_doc])

    def _row(self, lens, restore):
        n = self.world_size
        bad = [s for s in lens if s % (2 * n)]
        if bad:
            raise ValueError(f"_PerDocumentHeadTailLoadBalancer: every document length must be divisible by "
                             f"2 * world_size = {2 * n}, got {list(lens)}")
        idx, start = [], 0
        for s in lens:
            c = s // (2 * n)
            for r in range(n):
                idx.extend(range(start + c * r, start + c * (r + 1)))
                idx.extend(range(start + c * (2 * n - r) - c, start + c * (2 * n - r)))
            start += s
        out = torch.tensor(idx, dtype=torch.long, device=self.device)
        return _restore(out) if restore else out


class _PTRRLoadBalancer(_LoadBalancer):
    """Processing-time round-robin over the blocks of a FlexAttention ``BlockMask`` (torch's scheduling)."""

    def __init__(self, block_mask, world_size: int):
        self.block_mask = block_mask
        self.world_size = world_size

    @staticmethod
    def ptrr_scheduling(process_time, group_size: int):
        """Tasks (block indices) per group, ``(group_size, n // group_size)``, each row sorted (torch's)."""
        if process_time.ndim != 1:
            raise ValueError(f"ptrr_scheduling: process_time must be 1-D, got shape {tuple(process_time.shape)}")
        n = process_time.size(0)
        if n % group_size:
            raise NotImplementedError(f"num_tasks {n} must be divisible by group_size {group_size}")
        _, desc = torch.sort(process_time, descending=True, stable=True)
        rev = torch.flip(desc.view(-1, group_size), dims=[1]).view(-1)
        tasks = torch.where(torch.arange(n, device=desc.device) // group_size % 2 == 0, desc, rev)
        tasks = tasks.view(-1, group_size).transpose(0, 1)
        return torch.sort(tasks, dim=1)[0]

    def _generate_indices(self, restore: bool = False):
        bm = self.block_mask
        blocks = bm.kv_num_blocks + bm.full_kv_num_blocks if bm.full_kv_num_blocks is not None else bm.kv_num_blocks
        B, H, Q = blocks.shape
        if H != 1:
            raise ValueError(f"_PTRRLoadBalancer: the block mask must be the same for every head (H == 1), got H={H}")
        blocks = blocks.reshape(-1, Q)
        q_blk, kv_blk = bm.BLOCK_SIZE
        if q_blk != kv_blk:
            raise ValueError(f"_PTRRLoadBalancer: only equal q/kv block sizes are supported, got {bm.BLOCK_SIZE}")
        rows = []
        for b in range(blocks.shape[0]):
            order = self.ptrr_scheduling(blocks[b], self.world_size).reshape(-1)
            pos = torch.arange(q_blk * order.numel(), device=order.device).view(-1, q_blk)
            rows.append(pos[order].reshape(-1))
        out = torch.stack(rows)
        return _restore(out) if restore else out


def _create_default_load_balancer(seq_length: int, world_size: int, device):
    """torch's default: head-tail when ``options.enable_load_balance`` and ``2 * world_size`` divides the length."""
    from hyper_parallel.context_parallel.api import options
    if options.enable_load_balance and seq_length % (world_size * 2) == 0:
        return _HeadTailLoadBalancer(seq_length, world_size, device)
    return None


__all__ = ["_LoadBalancer", "_HeadTailLoadBalancer", "_PerDocumentHeadTailLoadBalancer", "_PTRRLoadBalancer",
           "_create_default_load_balancer"]
