"""HyperParallel's ``hsdp`` entry point on the ``fully_shard`` machinery, plus ZeRO-1/2.

``hsdp(module, shard_size=-1, threshold=64, optimizer_level="level1", ...)``
follows HyperParallel's ``core/hsdp/api.py`` (signature and argument checks);
apply it to each block, then to the root, as with ``fully_shard``:

==============  ======================================================================
level           what is sharded / what is communicated (per group and step)
==============  ======================================================================
``level1``      weights + optimizer state; the full gradient is all-reduced and kept
                (one all_reduce), weights gathered once before forward and kept
                through backward (one all_gather)
``level2``      + gradients: one reduce_scatter instead of the all_reduce
``level3``      + weights re-gathered before backward (freed after forward), i.e.
                FSDP2's ``reshard_after_forward=True``
``zero1``       ZeRO-1: optimizer state only. Weights stay replicated (each rank's
                shard is a view of its rows of the full weight); gradients are
                all-reduced; after an optimizer step the updated rows are
                all-gathered once, at the next forward
``zero2``       ZeRO-2: ``zero1`` with gradients reduce-scattered (sharded)
==============  ======================================================================

Gradients follow HyperParallel's convention, not FSDP2's: they are **summed**
over the data-parallel ranks (no mean) and then multiplied by ``grad_scale``
(default 1.0), so a program whose per-rank losses are means passes
``grad_scale=1/world`` (or seeds its backward accordingly).

``threshold`` (KB): plain parameters smaller than this stay replicated (each
gradient summed over all ranks, in one flat all_reduce per backward).
``shard_size``: shard over groups of that many consecutive ranks and replicate
across groups (an HSDP mesh ``(world / shard_size, shard_size)``).
``reduce_dtype`` is the reduction dtype. Parameters that are already DTensors
(a ``Layout`` or TP plan applied first) are left in their layout, not sharded:
the DTensor dispatcher gives them whole gradients already, so hsdp only applies
``grad_scale`` to them. Communication
is always asynchronous and fused per group here, so ``comm_async``,
``comm_fusion`` and ``bucket_size`` are checked and otherwise need nothing.
"""
from __future__ import annotations

from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.fsdp import state
from hyper_parallel.fsdp.api import FSDPModule, plan_params
from hyper_parallel.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.distributed import groups

LEVELS = {
    "level1": dict(reshard_after_forward=False, _grad_reduce="all_reduce", _persistent=False),
    "level2": dict(reshard_after_forward=False, _grad_reduce="reduce_scatter", _persistent=False),
    "level3": dict(reshard_after_forward=True, _grad_reduce="reduce_scatter", _persistent=False),
    "zero1": dict(reshard_after_forward=False, _grad_reduce="all_reduce", _persistent=True),
    "zero2": dict(reshard_after_forward=False, _grad_reduce="reduce_scatter", _persistent=True),
}
_MESHES = {}


class HSDPModule(FSDPModule):
    """What ``hsdp`` makes of a module: the FSDP2 methods plus HyperParallel's ``HSDPCell`` ones."""

    def set_requires_grad_sync(self, requires_grad_sync):
        if not isinstance(requires_grad_sync, bool):
            raise ValueError(f"requires_grad_sync must be bool but got {requires_grad_sync}.")
        self.set_requires_gradient_sync(requires_grad_sync)

    def zero_grads(self):
        for p in self.parameters():
            p.grad = None
        for s in self._hp_states(True):
            if s.group is not None:
                for fp in s.group.params:
                    if fp.unsharded is not None:
                        fp.unsharded.grad = None

    def set_forward_prefetch_cells(self, hsdp_cell_list):
        if not isinstance(hsdp_cell_list, (tuple, list)):
            raise ValueError("hsdp_cell_list must be HSDPCell list")
        self.set_modules_to_forward_prefetch(list(hsdp_cell_list))

    def set_backward_prefetch_cells(self, hsdp_cell_list):
        if not isinstance(hsdp_cell_list, (tuple, list)):
            raise ValueError("hsdp_cell_list must be HSDPCell list")
        self.set_modules_to_backward_prefetch(list(hsdp_cell_list))


def _mesh(shard_size):
    from hyper_parallel.dtensor.device_mesh import init_device_mesh
    world = groups.get_world_size()
    k = world if shard_size == -1 else shard_size
    if k > world or world % k:
        raise ValueError(f"hsdp: shard_size={shard_size} must divide the world size {world} (or be -1)")
    key = (world, k)
    if key not in _MESHES:
        dev = "cpu"
        if k == world:
            _MESHES[key] = (init_device_mesh(dev, (world,)), None)
        else:
            m = init_device_mesh(dev, (world // k, k), mesh_dim_names=("hsdp_replicate", "hsdp_shard"))
            _MESHES[key] = (m, m._flatten("hsdp_all"))
    mesh, flat = _MESHES[key]
    return mesh, (flat if flat is not None else mesh)


def hsdp(module, shard_size=-1, threshold=64, optimizer_level="level1", enable_grad_accumulation=False,
         grad_scale=1.0, reduce_dtype=None, comm_async=False, comm_fusion=False, bucket_size=-1,
         use_eager_hook=True):
    """Hybrid sharded data parallelism (HyperParallel's API); see the module docstring for the levels."""
    if not hasattr(module, "parameters") or not hasattr(module, "_parameters"):
        raise ValueError(f"cell's type must be nn.Module but got {type(module)}.")
    if not isinstance(shard_size, int) or (shard_size <= 0 and shard_size != -1):
        raise ValueError(f"shard_size must be a positive integer, but got {shard_size}.")
    if not isinstance(threshold, int) or threshold < 0:
        raise ValueError(f"threshold must be a positive integer or 0, but got {threshold}.")
    if optimizer_level not in LEVELS:
        raise ValueError(f"Optimizer level should in {list(LEVELS)}, but got {optimizer_level}.")
    for name, v in (("enable_grad_accumulation", enable_grad_accumulation), ("comm_async", comm_async),
                    ("comm_fusion", comm_fusion), ("use_eager_hook", use_eager_hook)):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be bool but got {v}.")
    if not isinstance(grad_scale, float):
        raise ValueError(f"grad_scale must be float but got {grad_scale}.")
    if reduce_dtype is not None and not getattr(reduce_dtype, "is_floating_point", False):
        raise ValueError(f"reduce_dtype must be a floating dtype but got {reduce_dtype}.")
    if not isinstance(bucket_size, int) or (bucket_size < 0 and bucket_size != -1):
        raise ValueError(f"bucket_size must be a positive integer or 0, but got {bucket_size}.")
    mesh, world_mesh = _mesh(shard_size)
    own = {id(p) for p in module.parameters()}
    plain, dtensors = [], []
    for m in module.modules():
        if m is not module and isinstance(m, FSDPModule):
            continue
        for p in m._parameters.values():
            if p is not None and id(p) in own:
                (dtensors if _is_dtensor(p) else plain).append(p)
    # plain parameters below the threshold stay replicated: gradients summed over every rank
    small = [p for p in plain if p.numel() * p.element_size() < threshold * 1024]
    # fully_shard's checks (module, mesh, parameters) before anything changes
    mesh, params = plan_params(module, mesh, small + dtensors, None)
    # DTensor parameters (a Layout/TP plan applied before hsdp) stay as they are: the DTensor
    # dispatcher already gives them the whole gradient (what HyperParallel's sum over their
    # replicating ranks computes), so hsdp only applies grad_scale to them
    state.scale_grads(dtensors, grad_scale)
    state.replicate_small(small, world_mesh, grad_scale)
    kw = LEVELS[optimizer_level]
    state.fully_shard(module, mesh=mesh, params=params,
                        mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype), offload_policy=OffloadPolicy(),
                        module_cls=HSDPModule, **kw)
    fsdp_state = module._hp_fsdp_state
    if fsdp_state.group is not None:
        # HyperParallel reduces with a plain sum, then multiplies by grad_scale (not a mean)
        fsdp_state.group.divide_factor = 1.0 / grad_scale
    fsdp_state.hsdp_level = optimizer_level
    return module


def _is_dtensor(value) -> bool:
    return isinstance(value, DTensor)
