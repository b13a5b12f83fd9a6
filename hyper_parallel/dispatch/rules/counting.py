"""Ops whose output is counted from the data: ``histc`` and ``nonzero`` / ``argwhere``.

* ``histc``: with an explicit range, each rank counts its own shard and the result is ``Partial(sum)``
  (nothing moves until it is read); with the data-dependent default range the input is replicated.
* ``nonzero`` / ``argwhere``: data-dependent shape: replicated.
"""
from __future__ import annotations

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy
from hyper_parallel.dispatch.rules.base import bind_args as _bind
from hyper_parallel.dispatch.rules.padding_repeat import _np, _self



class HistcRule(DistributedOp):
    float_args_matter = True  # the range decides the strategy

    def strategy(self, call):
        lay, shape = _self(call)
        v = _bind(call.args, call.kwargs, ("input", "bins", "min", "max"))
        lo, hi = v.get("min", 0), v.get("max", 0)
        if lo == hi:  # the range comes from the data: every rank needs all of it
            return Strategy([lay.replicated(len(shape))], lay.replicated(1))
        tgt = _np(lay)
        partial = ["sum" if d in tgt.sharded_mesh_dims() else None for d in range(tgt.mesh_ndim)]
        return Strategy([tgt], tgt.with_dim_map(((),), partial))


class NonzeroRule(DistributedOp):
    float_args_matter = False

    def strategy(self, call):
        lay, shape = _self(call)
        v = _bind(call.args, call.kwargs, ("input",))
        tgt = lay.replicated(len(shape))
        if v.get("as_tuple"):
            return Strategy([tgt], [tgt.replicated(1)] * max(len(shape), 1))
        return Strategy([tgt], tgt.replicated(2))


def register_all():
    HistcRule("histc")
    NonzeroRule("nonzero")
    NonzeroRule("argwhere")


__all__ = ["HistcRule", "NonzeroRule", "register_all"]
