"""``torch.distributed.tensor.experimental``, spelled for hyper_parallel.

Mirrors PyTorch's module (see :mod:`hyper_parallel.placement_types`) for what
hyper_parallel has: ``local_map`` and ``implicit_replication``. PyTorch's
``context_parallel`` and ``register_sharding`` are not provided (custom sharding
rules are registered with :class:`hyper_parallel.DistributedOp`).
"""
from hyper_parallel.core.shard import local_map
from hyper_parallel.core.shard._op_dispatch import implicit_replication

__all__ = ["implicit_replication", "local_map"]
