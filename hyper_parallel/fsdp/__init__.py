"""Data parallelism (the torch-mirrored path ``torch.distributed.fsdp`` too): ``replicate`` (DDP), ``fully_shard`` (FSDP2 API), HSDP and HyperParallel's ``hsdp`` (ZeRO-1/2/3).

Design (one screen)
-------------------
* **One home for every data-parallel flavour.** ``ddp.py``: ``replicate`` (parameters replicated,
  gradients averaged in one flat all_reduce per backward, through ``distributed/deferred_grads.py``).
  ``api.py``: ``fully_shard`` / ``FSDPModule`` / ``UnshardHandle``, every argument checked and the plan of
  which parameter is sharded on which dim made before anything changes. ``hsdp.py``: an alias of
  HyperParallel's ``hsdp`` (levels 1/2/3 = ZeRO-1/2/3, ``threshold``, ``shard_size``), whose code on these
  mechanics lives in ``compat/hyperparallel/hsdp.py``.
  ``policies.py``: ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``. ``mesh_info.py``:
  torch 2.13's ``ShardPlacementResult`` / ``FSDPMeshInfo`` (a parameter sharded on another dp mesh,
  e.g. MoE experts on the expert-data-parallel mesh) and ``_get_mesh_info`` (``get_mesh_info``).
* **Mechanics.** ``param.py``: one managed parameter (its sharded DTensor, its unsharded leaf, its place in
  the flat buffer); ``param_group.py``: one flat all_gather and one flat reduce_scatter (or all_reduce)
  per module group, asynchronous; ``mesh_groups.py``: a module's groups when its parameters sit on
  several dp meshes (one per mesh, as torch); ``state.py``: the forward/backward hooks with prefetching and the
  root's end-of-backward callback.
* **Imports.** The ground floor, ``dtensor``, ``dispatch``, and ``compile.compile_mode.eager_hook`` (FSDP's
  hooks stay eager under ``torch.compile``). No other parallelism package.

Docs: ``docs/fsdp.md``.
"""
from hyper_parallel.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy
from hyper_parallel.fsdp.api import fully_shard, FSDPModule, UnshardHandle
from hyper_parallel.fsdp.ddp import data_parallel, replicate
from hyper_parallel.fsdp.spmd_mesh import DataParallelMeshDims
from hyper_parallel.fsdp.mesh_info import (ShardPlacementResult, DataParallelMeshInfo, FSDPMeshInfo, HSDPMeshInfo,
                                           DDPMeshInfo, get_mesh_info)

__all__ = ["replicate", "data_parallel", "hsdp", "fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy",
           "CPUOffloadPolicy", "DataParallelMeshDims", "ShardPlacementResult", "DataParallelMeshInfo", "FSDPMeshInfo",
           "HSDPMeshInfo", "DDPMeshInfo", "get_mesh_info"]


def __getattr__(name: str):
    """``hsdp``: HyperParallel's entry point, a facade of its code in ``compat/hyperparallel/hsdp.py``.

    Resolved on first use, not at import: that module builds on this package (``FSDPModule``), so an
    eager import here would be circular when it is imported first.
    """
    if name == "hsdp":
        from hyper_parallel.compat.hyperparallel.hsdp import hsdp
        globals()["hsdp"] = hsdp
        return hsdp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
