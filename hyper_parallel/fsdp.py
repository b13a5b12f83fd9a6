"""Public FSDP module (``torch.distributed.fsdp``'s FSDP2 names): ``from hyper_parallel.fsdp import fully_shard``."""
from hyper_parallel.data_parallel import (fully_shard, FSDPModule, UnshardHandle, MixedPrecisionPolicy, OffloadPolicy,
                                      CPUOffloadPolicy)

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]
