"""hyper_parallel: distributed tensors, sharded operators and tensor parallelism.

Quick start::

    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = hp.distribute_tensor(torch.randn(8, 8), mesh, [hp.Shard(0), hp.Replicate()])
    y = x.redistribute(mesh, ("None", "tp"))      # alias spelling, one name per tensor dim
"""
from importlib import import_module as _import_module
from typing import Optional

from hyper_parallel.distributed import groups
from hyper_parallel.dtensor.placement_types import Placement, Shard, Replicate, Partial
from hyper_parallel.dtensor.layout import Layout
from hyper_parallel.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.dtensor.api import (
    distribute_tensor, distribute_module, ones, zeros, empty, full, rand, randn)
from hyper_parallel.dtensor.random import manual_seed
from hyper_parallel.dtensor import function_bridge as _function_bridge  # noqa: F401  (autograd.Function on DTensors)
from hyper_parallel.debug import CommDebugMode  # also hands CommDebugMode to hyper_parallel.dtensor (its HP path)
from hyper_parallel.dispatch import DistributedOp, DFunction, SkipDTensorDispatch, custom_shard
from hyper_parallel.dispatch import local_map
from hyper_parallel.dispatch.modes import (implicit_replication, allow_replicate_fallback, set_debug,
                                             set_strict_layouts, strict_layouts, StrictLayoutError)

# Names of the parallelism packages and facades, imported on first use (module ``__getattr__``) so that
# importing the core (``import hyper_parallel.dtensor``) does not load FSDP, pipelining, MoE, CP or the
# planner. ``hp.fully_shard`` and ``from hyper_parallel import fully_shard`` work as before.
_LAZY = {
    "ShardingPlan": "hyper_parallel.compat.hyperparallel.sharding_plan",
    "shard_module": "hyper_parallel.compat.hyperparallel.shard_module",
    **{name: "hyper_parallel.tensor_parallel" for name in (
        "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "NoParallel",
        "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "parallelize_module",
        "loss_parallel")},
    **{name: "hyper_parallel.fsdp" for name in (
        "data_parallel", "replicate", "fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
        "CPUOffloadPolicy")},
    "hsdp": "hyper_parallel.compat.hyperparallel.hsdp",
}
# subpackages reachable as attributes without an explicit import (``hp.core.dtensor``, HyperParallel's paths)
_LAZY_MODULES = ("core", "auto", "checkpoint", "compile", "context_parallel", "debug", "fsdp", "moe",
                 "pipelining", "tensor_parallel", "swap")


def __getattr__(name: str):
    home = _LAZY.get(name)
    if home is not None:
        value = getattr(_import_module(home), name)
    elif name in _LAZY_MODULES:
        value = _import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))


def _compose():
    """The composition root: the two torch patches that need the DTensor class are wired here.

    ``torch.testing``'s DTensor comparison rule (``dtensor/patch_testing.py``) learns our class, and
    ``async_save``'s stager learns to copy it (``checkpoint/staging.py``). Both are patches of torch
    globals, listed with their reasons in docs/design.md ("Patches of torch"). HyperParallel's semantics
    (``compat/hyperparallel/semantics.py``) are handed to the core here, its one registration point
    (``dtensor/mesh_semantics.py``): meshes made by HyperParallel's entry points follow them.
    """
    from hyper_parallel.dtensor import patch_testing
    from hyper_parallel.checkpoint import staging
    from hyper_parallel.compat.hyperparallel import semantics as hp_semantics
    patch_testing.register_dtensor_class(DTensor)
    staging.install()
    hp_semantics.register()


_compose()

__version__ = "0.1.0"


def init_process_group(device_type: Optional[str] = None, timeout_s: Optional[float] = None) -> None:
    """Initialise the default process group from torchrun's environment, if not yet done.

    What ``init_device_mesh`` does first; call it yourself to initialise before building a mesh.
    Under torchrun's shared agent store every restart attempt gets a key space of its own (an
    elastic restart works after ``new_group``), and the process groups are destroyed and freed
    at interpreter exit (docs/checkpoint.md "Elastic restart", docs/testing.md). ``device_type``:
    "cpu" (gloo) or "cuda" (nccl; default when CUDA is available); ``timeout_s``: collective
    timeout (default ``HYPER_PARALLEL_COLLECTIVE_TIMEOUT`` or 600 s).
    """
    groups.init_process_group(device_type or groups.default_device_type(), timeout_s)


# The core API; the parallelism names above (``_LAZY``) stay reachable as ``hp.NAME`` and in their packages.
__all__ = [
    "Placement", "Shard", "Replicate", "Partial", "Layout", "DeviceMesh", "init_device_mesh", "init_process_group",
    "DTensor", "distribute_tensor", "distribute_module", "ones", "zeros", "empty", "full", "rand", "randn",
    "manual_seed", "local_map", "DFunction", "DistributedOp", "SkipDTensorDispatch", "custom_shard",
    "implicit_replication", "strict_layouts", "set_strict_layouts", "StrictLayoutError", "CommDebugMode",
]
