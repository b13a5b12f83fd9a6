"""``hyper_parallel.core.hsdp.api.hsdp`` (HyperParallel's module path)."""
from hyper_parallel.compat.hyperparallel.hsdp import hsdp, HSDPModule

__all__ = ["hsdp", "HSDPModule"]
