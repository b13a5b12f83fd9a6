"""``torch.distributed.tensor.placement_types``, spelled for hyper_parallel.

One of the modules that mirror PyTorch's layout, so that swapping the
``torch.distributed.tensor`` prefix for ``hyper_parallel`` works; the
placements live in :mod:`hyper_parallel.dtensor.placement_types`.
"""
from hyper_parallel.dtensor.placement_types import (Partial, Placement, Replicate, Shard, _Partial,  # noqa: F401
                                                    _StridedShard, _StridedShardOffsetMode, _is_shard_like)

__all__ = ["Placement", "Shard", "Replicate", "Partial"]
