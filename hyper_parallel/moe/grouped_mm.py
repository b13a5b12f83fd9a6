"""``grouped_mm(x, w, offsets)``: the experts' grouped matmul (kernels: ``dispatch/rules/grouped_mm_kernels.py``).

On plain tensors it picks ``torch._grouped_mm`` where torch runs it and an exact loop elsewhere; on
DTensors (expert-sharded ``w``) the call goes to the ``_grouped_mm`` sharding rule, whose local kernel is
the same code.
"""
from __future__ import annotations

import torch

from hyper_parallel.dispatch.rules.grouped_mm_kernels import _native, grouped_mm_local, grouped_mm_loop, native_supported

__all__ = ["grouped_mm", "grouped_mm_local", "grouped_mm_loop", "native_supported"]


def grouped_mm(inputs: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, *,
               impl: str = "auto") -> torch.Tensor:
    """``out[rows of g] = x[rows of g] @ w[g]`` (see the module docstring); ``impl``: auto, native, loop.

    On DTensors (expert-sharded ``weights``) the call goes to the ``_grouped_mm`` sharding rule
    (``hyper_parallel/dispatch/rules/grouped_mm.py``).
    """
    if impl not in ("auto", "native", "loop"):
        raise ValueError(f"grouped_mm: impl must be 'auto', 'native' or 'loop', got {impl!r}")
    if inputs.dim() != 2 or weights.dim() != 3:
        raise ValueError(f"grouped_mm: x must be [T, in] and w [G, in, out], got shapes {tuple(inputs.shape)} and "
                         f"{tuple(weights.shape)}")
    if inputs.shape[1] != weights.shape[1]:
        raise ValueError(f"grouped_mm: inputs has {inputs.shape[1]} features but weights expects {weights.shape[1]} "
                         "(weights is [G, in, out])")
    if offsets.dim() != 1 or offsets.shape[0] != weights.shape[0]:
        raise ValueError(f"grouped_mm: offsets must be [G] = [{weights.shape[0]}] cumulative row ends, got shape "
                         f"{tuple(offsets.shape)}")
    from hyper_parallel.dtensor.dtensor import DTensor
    if isinstance(inputs, DTensor) or isinstance(weights, DTensor):
        return torch._grouped_mm(inputs, weights, offs=offsets)
    if impl == "native" or (impl == "auto" and native_supported(inputs, weights)):
        return _native(inputs, weights, offsets)
    return grouped_mm_loop(inputs, weights, offsets)
