"""Fully sharded data parallelism (FSDP2 API) and HyperParallel's ``hsdp`` entry point."""
from hyper_parallel.core.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy
from hyper_parallel.core.fsdp.api import fully_shard, FSDPModule, UnshardHandle

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy",
           "CPUOffloadPolicy"]
