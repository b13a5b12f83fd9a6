"""The one import-swap table: which hyper_parallel object stands for each torch DTensor name.

Read by the swap (:mod:`hyper_parallel.compat.torch.swap`, ``python -m hyper_parallel.swap``) and by the
tool that swaps PyTorch's own test files (``tools/torch_tests/swap.py``), so both run a torch program on
the same objects. Data, plus :func:`home_of`, the lookup both use: the ``(module, attribute)`` that
``from <torch module> import <name>`` binds, or None when hyper_parallel has no counterpart (the swap
then binds a raising placeholder, the tool keeps torch's name).

Rules, in order: without ``swap_mesh`` the mesh names (``DeviceMesh``, ``init_device_mesh``) imported from
a swapped module stay torch's (the program keeps torch's meshes, which every hyper_parallel API accepts);
``NAMES`` where our module spells a name differently; else the mirrored module of ``MODULES`` (plus
``MESH_MODULES`` with ``swap_mesh``) if it has the name.
"""
from __future__ import annotations

import importlib
from typing import Dict, Optional, Tuple

# torch module -> hyper_parallel module that mirrors it. Names missing from ours come from NAMES, then
# (FALLBACK_TO_TORCH modules only) from torch's module, else a raising placeholder.
MODULES: Dict[str, str] = {
    "torch.distributed.tensor": "hyper_parallel",
    "torch.distributed._tensor": "hyper_parallel",
    "torch.distributed.tensor.parallel": "hyper_parallel.parallel",
    "torch.distributed.tensor.parallel.style": "hyper_parallel.parallel.style",
    "torch.distributed.tensor.parallel.api": "hyper_parallel.parallel.api",
    "torch.distributed.tensor.parallel.loss": "hyper_parallel.parallel.loss",
    "torch.distributed.tensor.placement_types": "hyper_parallel.placement_types",
    "torch.distributed.tensor.experimental": "hyper_parallel.experimental",
    "torch.distributed.tensor.experimental._func_map": "hyper_parallel.experimental",
    "torch.distributed.tensor.experimental._attention": "hyper_parallel.experimental._attention",
    "torch.distributed.tensor.experimental._context_parallel._attention": "hyper_parallel.experimental._attention",
    "torch.distributed.tensor.experimental._context_parallel": "hyper_parallel.experimental._attention",
    "torch.distributed.tensor.experimental._context_parallel._load_balancer":
        "hyper_parallel.context_parallel.load_balancer",
    "torch.distributed.tensor.debug": "hyper_parallel.debug",
    "torch.distributed.tensor.device_mesh": "hyper_parallel.device_mesh",
    "torch.distributed.tensor._random": "hyper_parallel.compat.torch.private_functions",
    "torch.distributed.fsdp": "hyper_parallel.fsdp",
    "torch.distributed._composable.fsdp": "hyper_parallel.fsdp",
    "torch.distributed._composable.fsdp.fully_shard": "hyper_parallel.fsdp",
    "torch.distributed.pipelining": "hyper_parallel.pipelining",
    "torch.distributed.pipelining.schedules": "hyper_parallel.pipelining",
    "torch.distributed.pipelining.stage": "hyper_parallel.pipelining",
    "torch.distributed.pipelining.microbatch": "hyper_parallel.pipelining",
}
MESH_MODULES = {"torch.distributed.device_mesh": "hyper_parallel.device_mesh"}

# Our pipelining classes subclass torch's and run torch's runtime: torch's private helpers of those
# modules (``_PipelineSchedule``, ``_normalize_model_output_as_tuple``) are valid with them.
FALLBACK_TO_TORCH = ("torch.distributed.pipelining",)

# Prefixes whose every module is swapped; a submodule missing from MODULES is unsupported as a whole.
PREFIXES = ("torch.distributed.tensor", "torch.distributed._tensor", "torch.distributed.fsdp",
            "torch.distributed._composable.fsdp", "torch.distributed.pipelining")

# (torch module, name) -> "hyper_parallel.module:attr" where the mirrored module's own name differs.
NAMES: Dict[tuple, str] = {
    ("torch.distributed.tensor", "init_device_mesh"): "hyper_parallel.device_mesh:init_device_mesh",
    ("torch.distributed._tensor", "init_device_mesh"): "hyper_parallel.device_mesh:init_device_mesh",
    ("torch.distributed.tensor.experimental._func_map", "local_map"): "hyper_parallel.experimental:local_map",
    # per-parameter dp meshes of fully_shard(shard_placement_fn=...) (torchtitan's experts at EP > 1)
    ("torch.distributed.fsdp._fully_shard._fsdp_common", "ShardPlacementResult"):
        "hyper_parallel.fsdp:ShardPlacementResult",
    ("torch.distributed.fsdp._fully_shard._fsdp_common", "DataParallelMeshInfo"):
        "hyper_parallel.fsdp:DataParallelMeshInfo",
    ("torch.distributed.fsdp._fully_shard._fsdp_common", "FSDPMeshInfo"): "hyper_parallel.fsdp:FSDPMeshInfo",
    ("torch.distributed.fsdp._fully_shard._fsdp_common", "HSDPMeshInfo"): "hyper_parallel.fsdp:HSDPMeshInfo",
    ("torch.distributed.fsdp._fully_shard._fsdp_common", "DDPMeshInfo"): "hyper_parallel.fsdp:DDPMeshInfo",
    ("torch.distributed.fsdp._fully_shard._fsdp_init", "_get_mesh_info"): "hyper_parallel.fsdp:get_mesh_info",
    # torch's private helpers that Hugging Face transformers' tensor parallelism and DCP-style code call
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"):
        "hyper_parallel.compat.torch.private_functions:compute_local_shape_and_global_offset",
}

# The names a program keeps from torch unless the mesh is swapped too (``--swap-mesh``).
MESH_NAMES = ("DeviceMesh", "init_device_mesh")
TORCH_MESH_MODULE = "torch.distributed.device_mesh"

# Why a torch name has no counterpart, added to its placeholder's error.
HINTS: Dict[str, str] = {}


def module_mapping(swap_mesh: bool) -> Dict[str, str]:
    """torch module -> the hyper_parallel module that mirrors it (with ``swap_mesh``: the mesh module too)."""
    return {**MODULES, **MESH_MODULES} if swap_mesh else MODULES


def is_swapped(modname: str, swap_mesh: bool) -> bool:
    """Whether imports from torch module ``modname`` are swapped (mirrored, or under a swapped prefix)."""
    if modname in module_mapping(swap_mesh):
        return True
    return any(modname == p or modname.startswith(p + ".") for p in PREFIXES)


def home_of(modname: str, name: str, swap_mesh: bool) -> Optional[Tuple[str, str]]:
    """``(module, attribute)`` bound for ``from modname import name`` (a swapped module), or None if we lack it."""
    if not swap_mesh and name in MESH_NAMES:
        return TORCH_MESH_MODULE, name
    target = NAMES.get((modname, name))
    if target is not None:
        module, attr = target.split(":")
        return module, attr
    ours = module_mapping(swap_mesh).get(modname)
    if ours is not None and hasattr(importlib.import_module(ours), name):
        return ours, name
    return None


__all__ = ["MODULES", "MESH_MODULES", "FALLBACK_TO_TORCH", "PREFIXES", "NAMES", "MESH_NAMES", "HINTS",
           "module_mapping", "is_swapped", "home_of"]
