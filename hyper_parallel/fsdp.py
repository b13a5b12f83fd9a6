"""Public FSDP module (``torch.distributed.fsdp``'s FSDP2 names): ``from hyper_parallel.fsdp import fully_shard``."""
from hyper_parallel.core.fsdp import (fully_shard, FSDPModule, UnshardHandle, MixedPrecisionPolicy, OffloadPolicy,
                                      CPUOffloadPolicy)
from hyper_parallel.core.fsdp.spmd_mesh import DataParallelMeshDims

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
           "DataParallelMeshDims"]
