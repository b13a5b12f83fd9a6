"""ShardingPlan: HyperParallel's declarative description of how to shard a module.

Pure data, consumed by :func:`hyper_parallel.compat.hyperparallel.shard_module.shard_module`:

* ``plan``: parameter name (as in ``named_parameters()``) -> layout, written as
  placements (``(Replicate(), Shard(1))``), alias names (``("None", "tp")``,
  one per tensor dim) or a :class:`Layout`;
* ``input_plan`` / ``output_plan``: ``"input"`` / ``"output"`` for the module
  itself, ``"<submodule path>.input"`` / ``"<path>.output"`` for a submodule;
  the value is one layout (the first argument / the output), a list with one
  per positional argument / output, or a dict keyed by argument name;
* ``return_local_tensor``: submodule paths (``""`` = the module itself) whose
  DTensor outputs are turned into local tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass
class ShardingPlan:
    """How :func:`shard_module` lays out parameters, inputs and outputs (see the module docstring)."""

    plan: Optional[Dict[str, Any]] = None
    input_plan: Optional[Dict[str, Any]] = None
    output_plan: Optional[Dict[str, Any]] = None
    return_local_tensor: Optional[List[str]] = None


__all__ = ["ShardingPlan"]
