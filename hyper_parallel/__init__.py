"""hyper_parallel: distributed tensors, sharded operators and tensor parallelism.

Quick start::

    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = hp.distribute_tensor(torch.randn(8, 8), mesh, [hp.Shard(0), hp.Replicate()])
    y = x.redistribute(mesh, ("None", "tp"))      # alias spelling, one name per tensor dim
"""
from hyper_parallel.distributed import groups
from hyper_parallel.dtensor.placement_types import Placement, Shard, Replicate, Partial
from hyper_parallel.dtensor.layout import Layout
from hyper_parallel.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.dtensor.api import (
    distribute_tensor, distribute_module, ones, zeros, empty, full, rand, randn)
from hyper_parallel.dtensor.random import manual_seed
from hyper_parallel.dtensor import function_bridge as _function_bridge  # noqa: F401  (autograd.Function on DTensors)
from hyper_parallel.debug import CommDebugMode
from hyper_parallel.dispatch import DistributedOp, DFunction, SkipDTensorDispatch, custom_shard
from hyper_parallel.dispatch import local_map
from hyper_parallel.dispatch.modes import (implicit_replication, allow_replicate_fallback, set_debug,
                                             set_strict_layouts, strict_layouts, StrictLayoutError)

from hyper_parallel.dispatch.sharding_plan import ShardingPlan
from hyper_parallel.dispatch.shard_module import shard_module
from hyper_parallel.tensor_parallel import (ParallelStyle, ColwiseParallel, RowwiseParallel, SequenceParallel, NoParallel,
                                            PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput,
                                            parallelize_module, loss_parallel)
from hyper_parallel.fsdp import data_parallel
from hyper_parallel.fsdp import replicate
from hyper_parallel.fsdp import (fully_shard, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                      CPUOffloadPolicy)
from hyper_parallel.fsdp.hsdp import hsdp


def _compose():
    """The composition root: the two torch patches that need the DTensor class are wired here.

    ``torch.testing``'s DTensor comparison rule (``dtensor/patch_testing.py``) learns our class, and
    ``async_save``'s stager learns to copy it (``checkpoint/staging.py``). Both are patches of torch
    globals, listed with their reasons in docs/design.md ("Patches of torch").
    """
    from hyper_parallel.dtensor import patch_testing
    from hyper_parallel.checkpoint import staging
    patch_testing.register_dtensor_class(DTensor)
    staging.install()


_compose()

from hyper_parallel import core  # noqa: E402  HyperParallel's module paths, as attributes too (hp.core.dtensor...)

__version__ = "0.1.0"


def init_process_group(device_type: str = None, timeout_s: float = None) -> None:
    """Initialise the default process group from torchrun's environment, if not yet done.

    What ``init_device_mesh`` does first; call it yourself to initialise before building a mesh.
    Under torchrun's shared agent store every restart attempt gets a key space of its own (an
    elastic restart works after ``new_group``), and the process groups are destroyed and freed
    at interpreter exit (docs/checkpoint.md "Elastic restart", docs/testing.md). ``device_type``:
    "cpu" (gloo) or "cuda" (nccl; default when CUDA is available); ``timeout_s``: collective
    timeout (default ``HYPER_PARALLEL_COLLECTIVE_TIMEOUT`` or 600 s).
    """
    groups.init_process_group(device_type or groups.default_device_type(), timeout_s)


def _testing_reset():
    """Reset per-process caches between tests (used by the test harness)."""
    from hyper_parallel.dtensor import random as _r
    from hyper_parallel.dispatch import modes as _modes
    _r._state.update(seed=None, counter=0)
    _modes._reset()  # strict layouts, implicit replication, fallback, debug: back to the environment's


__all__ = [
    "Placement", "Shard", "Replicate", "Partial", "Layout", "DeviceMesh", "init_device_mesh",
    "DTensor", "distribute_tensor", "distribute_module", "ones", "zeros", "empty", "full", "rand", "randn",
    "manual_seed", "CommDebugMode", "DistributedOp", "DFunction", "SkipDTensorDispatch", "local_map", "custom_shard", "set_strict_layouts", "strict_layouts",
    "StrictLayoutError",
    "implicit_replication", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "NoParallel", "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "parallelize_module",
    "loss_parallel", "replicate", "data_parallel", "allow_replicate_fallback", "set_debug",
    "ShardingPlan", "shard_module",
    "fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "hsdp",
    "init_process_group",
]
