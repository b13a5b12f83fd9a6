"""The torch operations the context-parallel plan runs on: ring/all_to_all attention pieces, shard helpers.

SDPA interception (function mode, compile op, DTensor rule) lives in :mod:`.sdpa_interception`."""
from __future__ import annotations

import torch

from hyper_parallel.distributed import collectives as C
from hyper_parallel.distributed import differentiable as Fn
from hyper_parallel.context_parallel import ring as _ring
from hyper_parallel.context_parallel.ring import RingAttention


def ring_attention(query, key, value, plan):
    """Differentiable ring attention on local ``[B, H, L, D]`` tensors (see :mod:`.ring`)."""
    return RingAttention.apply(query, key, value, plan)


def all_to_all(tensor, group, split_dim, cat_dim, split_sizes, cat_sizes):
    """Differentiable all_to_all (uneven sizes allowed); backward is the inverse all_to_all."""
    if group is None or group.size == 1:
        return tensor
    return Fn.AllToAll.apply(tensor.contiguous(), split_dim, cat_dim, group, list(split_sizes), list(cat_sizes))


def repeat_heads(tensor, times: int, dim: int = 1):
    return tensor if times == 1 else tensor.repeat_interleave(times, dim=dim)


def take(tensor, dim: int, index):
    """``tensor`` rows ``index`` (a list of ints) along ``dim`` (differentiable)."""
    return torch.index_select(tensor, dim, torch.tensor(index, dtype=torch.long, device=tensor.device))


def all_gather(tensor, dim: int, group, sizes):
    if group is None or group.size == 1:
        return tensor
    return C.all_gather(tensor.contiguous(), dim, group, list(sizes))


def gather_ints(value: int, group, device):
    """Every rank's int ``value`` over ``group`` (one small all_gather)."""
    t = torch.tensor([int(value)], dtype=torch.long, device=device)
    if group is None or group.size == 1:
        return [int(value)]
    return [int(a) for a in C.all_gather(t, 0, group).tolist()]


def is_tensor(obj) -> bool:
    return isinstance(obj, torch.Tensor)


def set_stats(stats):
    """Benchmarks: a dict that ring steps add ``compute_s`` / ``wait_s`` to (None: off)."""
    _ring.STATS = stats


def resize_copy_(buffer, value):
    with torch.no_grad():
        buffer.resize_(value.shape)
        buffer.copy_(value)


def clone(tensor):
    with torch.no_grad():
        return tensor.clone()



def stack(tensors, dim: int = 0):
    return torch.stack(list(tensors), dim)


def gather_seq(tensor, dim: int, index_rows):
    """``tensor`` reordered along ``dim`` by ``index_rows`` (shape ``(1, S)`` or ``(B, S)``; batch dim 0), as torch's
    ``_context_parallel_shard`` does before sharding."""
    idx = torch.as_tensor(index_rows, dtype=torch.long, device=tensor.device)
    if dim == 0:
        return torch.index_select(tensor, 0, idx[0])
    if idx.shape[0] == 1:
        idx = idx.expand(tensor.shape[0], idx.shape[1])
    shape = [idx.shape[0]] + [1] * (dim - 1) + [idx.shape[1]] + [1] * (tensor.dim() - dim - 1)
    return torch.gather(tensor, dim, idx.reshape(shape).expand(tensor.shape))


def chunk_of(tensor, dim: int, chunks: int, index: int):
    """``torch.chunk(x, n, dim)[i]`` (empty past the last chunk), contiguous - DTensor's ``Shard`` local piece."""
    pieces = torch.chunk(tensor, chunks, dim)
    if index < len(pieces):
        return pieces[index].contiguous()
    shape = list(tensor.shape)
    shape[dim] = 0
    return tensor.new_empty(shape)


__all__ = ["ring_attention", "all_to_all", "repeat_heads", "take", "all_gather", "gather_ints", "is_tensor",
           "set_stats", "resize_copy_", "clone", "stack", "gather_seq", "chunk_of"]
