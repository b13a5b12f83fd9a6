"""HyperParallel's module path for ``hsdp`` (``from hyper_parallel.core.hsdp import hsdp``)."""
from hyper_parallel.compat.hyperparallel.hsdp import hsdp, HSDPModule

__all__ = ["hsdp", "HSDPModule"]
