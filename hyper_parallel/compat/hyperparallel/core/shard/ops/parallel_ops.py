"""HyperParallel's module path ``hyper_parallel.core.shard.ops.parallel_ops``: :class:`DistributedOp`.

``from hyper_parallel.core.shard.ops.parallel_ops import DistributedOp`` (the base class of
sharding rules) works as in HyperParallel; it is the same class as ``hyper_parallel.DistributedOp``. A rule's
``infer_layout(layouts, extra_args)`` may return one layout or, HyperParallel
style, a one-element tuple for a single-tensor output.
"""
from hyper_parallel.dispatch.rules.base import DistributedOp

__all__ = ["DistributedOp"]
