"""``hyper_parallel.core.hsdp.api.hsdp`` (HyperParallel's module path)."""
from hyper_parallel.fsdp.hsdp import hsdp, HSDPModule

__all__ = ["hsdp", "HSDPModule"]
