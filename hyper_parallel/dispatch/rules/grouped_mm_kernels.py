"""The local kernels of the ``_grouped_mm`` sharding rule (and of ``hyper_parallel.moe.grouped_mm``): ``torch._grouped_mm`` where torch runs it, an exact loop elsewhere.

``grouped_mm(x, w, offsets)``: ``x`` ``[T, in]`` rows grouped by expert, ``w`` ``[G, in, out]``,
``offsets`` ``[G]`` int32 cumulative row ends (``offsets[g]`` = end of group ``g``, as
``torch._grouped_mm``'s ``offs``); returns ``[T, out]`` with ``out[rows of g] = x[rows of g] @ w[g]``
(rows after ``offsets[-1]`` are 0).

``torch._grouped_mm`` runs on CUDA (bf16, fp16, fp32; checked on an H200 with torch 2.11: equal to
the loop, 3-33x faster in bf16) and in torch 2.13 on CPU for float32 / bfloat16 with 16-byte aligned
strides; it has no float64, and its backward rejects an expanded gradient (``out.sum()``'s), which
``_native`` makes contiguous first. The automatic choice (``impl="auto"``) takes the native kernel on CUDA for
bf16/fp16/fp32 inputs with 16-byte aligned rows and the loop everywhere else. The loop reads the
offsets on the host (free on CPU).
"""
from __future__ import annotations

import torch

_NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_native_ok_cache = {}


def _aligned(t: torch.Tensor) -> bool:
    return (t.shape[-1] * t.element_size()) % 16 == 0 and (t.shape[-2] * t.element_size()) % 16 == 0


def native_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``impl="auto"`` picks ``torch._grouped_mm`` for these inputs."""
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cuda" or x.dtype not in _NATIVE_DTYPES:
        return False
    if w.dtype != x.dtype or not _aligned(x) or not _aligned(w):
        return False
    key = (x.device.index, x.dtype)
    ok = _native_ok_cache.get(key)
    if ok is None:  # one probe per device and dtype (older GPUs have no kernel for some dtypes)
        try:
            a = torch.zeros(16, 16, device=x.device, dtype=x.dtype)
            b = torch.zeros(2, 16, 16, device=x.device, dtype=x.dtype)
            torch._grouped_mm(a, b, offs=torch.tensor([8, 16], device=x.device, dtype=torch.int32))
            ok = True
        except (RuntimeError, NotImplementedError):
            ok = False
        _native_ok_cache[key] = ok
    return ok


def _native(x, w, offsets):
    """``torch._grouped_mm``; its backward rejects an expanded (stride-0) gradient such as ``out.sum()``'s
    (torch 2.11/2.13, CPU and CUDA: "Invalid strides/sizes"), so the gradient is made contiguous first."""
    out = torch._grouped_mm(x, w, offs=offsets.to(torch.int32))
    if out.requires_grad:
        out.register_hook(torch.Tensor.contiguous)
    return out


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offsets, row_offset: int = 0,
                    group_offset: int = 0, num_groups: int = None) -> torch.Tensor:
    """The exact fallback, also the local kernel of the sharded rule.

    Computes groups ``group_offset .. group_offset + num_groups`` of ``w`` (``w`` holds just those) for
    the rows of ``x`` (which start at global row ``row_offset``); ``offsets`` are the global cumulative
    ends of all groups. Other rows are 0.
    """
    ends = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
    G = w.shape[0] if num_groups is None else num_groups
    n = x.shape[0]
    pieces, pos = [], 0
    for g in range(group_offset, group_offset + G):
        lo = ends[g - 1] if g > 0 else 0
        hi = ends[g]
        lo, hi = min(max(lo - row_offset, 0), n), min(max(hi - row_offset, 0), n)
        if lo > pos:
            pieces.append(x.new_zeros(lo - pos, w.shape[-1]))
        pieces.append(x[lo:hi] @ w[g - group_offset])   # also when empty: every w[g] gets a gradient
        pos = max(pos, hi)
    if pos < n:
        pieces.append(x.new_zeros(n - pos, w.shape[-1]))
    if not pieces:
        return x.new_zeros(n, w.shape[-1])
    return torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]


def grouped_mm_local(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, row_offset: int = 0,
                     group_offset: int = 0) -> torch.Tensor:
    """The local kernel of the ``_grouped_mm`` sharding rule: this rank's rows (from global row
    ``row_offset``) times its experts (from global expert ``group_offset``), global ``offsets``."""
    whole = row_offset == 0 and group_offset == 0 and w.shape[0] == offsets.shape[0]
    if whole and native_supported(x, w):
        return _native(x, w, offsets)
    return grouped_mm_loop(x, w, offsets, row_offset, group_offset, w.shape[0])
