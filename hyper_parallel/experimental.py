"""``torch.distributed.tensor.experimental``, spelled for hyper_parallel.

Mirrors PyTorch's module (see :mod:`hyper_parallel.placement_types`) for what
hyper_parallel has: ``local_map``, ``implicit_replication`` and ``register_sharding``
(PyTorch's decorator, on the :class:`hyper_parallel.DistributedOp` registry). PyTorch's
``context_parallel`` is not provided.
"""
from hyper_parallel.core.shard import local_map
from hyper_parallel.core.shard.modes import implicit_replication
from hyper_parallel.core.shard.ops.registered_sharding import register_sharding

__all__ = ["implicit_replication", "local_map", "register_sharding"]
