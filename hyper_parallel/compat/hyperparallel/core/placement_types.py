"""HyperParallel's module path ``hyper_parallel.core.placement_types``: the placement classes.

HyperParallel's programs (its shard tests: ``from hyper_parallel.core.placement_types import Shard,
Replicate``) import the placements from here; these are the library's own classes (identity, not
copies) from :mod:`hyper_parallel.dtensor.placement_types`.
"""
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["Placement", "Shard", "Replicate", "Partial"]
