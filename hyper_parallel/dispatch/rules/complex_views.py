"""``view_as_complex`` / ``view_as_real``: views between a real ``(..., 2)`` tensor and a complex one.

``view_as_complex`` drops the trailing size-2 dim (real, imaginary) and ``view_as_real`` adds it;
every other dim keeps its shards, so each rank runs the op on its own piece (torch's complex RoPE
on TP- or CP-sharded q/k: no communication). The trailing pair is never split: a DTensor sharded on
it is replicated there first (it has 2 elements). Both ops are linear over the reals, so Partial
inputs stay Partial.
"""
from __future__ import annotations

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt


class ViewAsComplexRule(DistributedOp):
    """``view_as_complex(x)``: output dims are ``x``'s without the last one (see the module docstring)."""

    float_args_matter = False

    def strategy(self, call):
        x = call.args[0] if call.args else call.kwargs.get("input")
        if not _is_dt(x):
            raise NotImplementedError(f"{call.name}: the input must be a DTensor")
        lay, shape = call.layouts[0], call.shapes[0]
        if not shape or shape[-1] != 2:
            raise ValueError(f"{call.name}: the input's last dim must have size 2 (real, imaginary), got shape "
                             f"{tuple(shape)}")
        dim_map = tuple(lay.dim_map)
        if dim_map[-1]:
            dim_map = dim_map[:-1] + ((),)
        src = lay.with_dim_map(dim_map, lay.partial)
        return Strategy([src], lay.with_dim_map(dim_map[:-1], lay.partial))


class ViewAsRealRule(DistributedOp):
    """``view_as_real(x)``: output dims are ``x``'s plus a trailing unsharded pair."""

    float_args_matter = False

    def strategy(self, call):
        x = call.args[0] if call.args else call.kwargs.get("input")
        if not _is_dt(x):
            raise NotImplementedError(f"{call.name}: the input must be a DTensor")
        lay = call.layouts[0]
        return Strategy([lay], lay.with_dim_map(tuple(lay.dim_map) + ((),), lay.partial))


def register_all():
    ViewAsComplexRule("view_as_complex")
    ViewAsRealRule("view_as_real")


__all__ = ["ViewAsComplexRule", "ViewAsRealRule", "register_all"]
