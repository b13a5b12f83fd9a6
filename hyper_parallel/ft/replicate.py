"""The fault-tolerant replicate dimension of HSDP: FSDP's reduced gradients all-reduced over the replica groups.

torchtitan's torchft path: ``set_all_reduce_hook`` on every FSDP module, the hook averaging the
reduce-scatter output over the live replica groups through the ``torchft.Manager`` (``allreduce``,
which is what ``ManagedProcessGroup`` calls; torchft's ``DistributedDataParallel`` wrapper is not used:
it crashes the survivor when a peer dies inside the all_reduce). An error in the collective (a dead
group) is recorded by the Manager, the step is not committed, and the next quorum leaves the dead
group out. :class:`CrossGroupBytes` counts what crosses the groups.
"""
from __future__ import annotations

import torch


class CrossGroupBytes:
    """Bytes of training data (gradients, pseudo-gradients) this rank sends into cross-group all_reduces.

    Installed on one Manager (:func:`count_cross_group_bytes`); both the synchronous hook and torchft's
    DiLoCo go through ``manager.allreduce``, so the two are counted alike.
    """

    def __init__(self):
        self.total = 0
        self.calls = 0


def count_cross_group_bytes(manager) -> CrossGroupBytes:
    """Wrap ``manager.allreduce`` (once) so that every tensor it reduces is counted; returns the counter."""
    counter = getattr(manager, "_hp_bytes", None)
    if counter is not None:
        return counter
    counter = manager._hp_bytes = CrossGroupBytes()
    inner = manager._hp_uncounted_allreduce = manager.allreduce  # state.check_same_model's probe is not counted

    def allreduce(tensor, *args, **kwargs):
        counter.total += tensor.numel() * tensor.element_size()
        counter.calls += 1
        return inner(tensor, *args, **kwargs)

    manager.allreduce = allreduce
    return counter


def replicate_over_groups(model: torch.nn.Module, manager) -> CrossGroupBytes:
    """Average every FSDP module's reduced gradients over the replica groups (torchft's replicate dim).

    ``model`` must be ``fully_shard``-ed at its root (the root's group holds every parameter no
    inner ``fully_shard`` took), so every gradient goes through a hook. Returns the byte counter.
    """
    from hyper_parallel.fsdp import FSDPModule
    if not isinstance(model, FSDPModule):
        raise ValueError(f"replicate_over_groups: the model ({type(model).__name__}) must be fully_shard-ed at its "
                         "root, so that every gradient is reduced by an FSDP module; call "
                         "fully_shard(model, mesh=...) after sharding its blocks")
    counter = count_cross_group_bytes(manager)

    def hook(reduce_output: torch.Tensor) -> None:
        manager.allreduce(reduce_output).wait()

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(hook)
    return counter
