"""``fully_shard`` and ``FSDPModule``: PyTorch FSDP2's API on hyper_parallel's DTensor.

``fully_shard(module, mesh=...)`` turns every parameter of ``module`` that is not
already managed by a ``fully_shard`` on a submodule into a DTensor sharded on
the data-parallel mesh (``Shard(0)``, uneven sizes by ``torch.chunk`` rules) and
swaps the module's class for a subclass of :class:`FSDPModule`. Those parameters
form one *group*: before the module's forward (and, when it resharded after
forward, before its backward) the group's shards are all-gathered in one flat
collective; after its backward the group's gradients are reduce-scattered in
one flat collective and averaged over the data-parallel ranks.

The mechanics are framework code (``hyper_parallel/platform/<framework>/fsdp_*.py``);
this module validates arguments and holds the framework-free surface.
"""
from __future__ import annotations

import importlib

from hyper_parallel.core.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.platform import get_platform


def _impl():
    """The framework's FSDP state module (lazy: core imports no framework)."""
    return importlib.import_module(f"hyper_parallel.platform.{get_platform().platform_type.value}.fsdp_state")


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` finishes the all_gather."""

    def __init__(self, group=None):
        self._group = group

    def wait(self):
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixin that ``fully_shard`` puts in front of a module's class (``FSDP<Class>``).

    Every method acts on this module's parameter group; ``recurse=True`` variants
    also act on ``fully_shard`` submodules.
    """

    def __new__(cls, *args, **kwargs):
        # FSDP<Class>(...) builds a plain Class instance (as FSDP2 does); fully_shard it again if needed
        orig = cls.__mro__[2]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def _hp_states(self, recurse: bool):
        mods = self.modules() if recurse else [self]
        return [m._hp_fsdp_state for m in mods if isinstance(m, FSDPModule)]

    def reshard(self) -> None:
        """Free the unsharded parameters; the module's parameters become the sharded DTensors again."""
        self._hp_fsdp_state.reshard()

    def unshard(self, async_op: bool = False):
        """All-gather the group's parameters now; with ``async_op=True`` return a handle whose ``wait()`` finishes it."""
        group = self._hp_fsdp_state.group
        if group is None:
            return UnshardHandle() if async_op else None
        group.unshard(async_op=True)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step (the root waits for reductions then)."""
        self._hp_fsdp_state.ctx_set("is_last_backward", bool(is_last_backward))

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: keep unsharded gradients locally (gradient accumulation); ``True``: reduce-scatter them."""
        for s in self._hp_states(recurse):
            s.requires_gradient_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether the replicate-dim all_reduce runs after the reduce_scatter."""
        for s in self._hp_states(recurse):
            s.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward: expected a bool, got {reshard_after_forward!r}")
        for s in self._hp_states(recurse):
            s.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for s in self._hp_states(recurse):
            s.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules) -> None:
        """All-gather these FSDP modules' groups right after this module's own, before its forward computes."""
        self._hp_fsdp_state.forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules) -> None:
        """All-gather these FSDP modules' groups right after this module's own in backward."""
        self._hp_fsdp_state.backward_prefetch = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel size."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor!r}")
        for s in self._hp_states(True):
            s.gradient_divide_factor = float(factor)

    def set_post_optim_event(self, event) -> None:  # CUDA streams only; nothing to order on CPU
        return None


def _state_of(module, what):
    if not isinstance(module, FSDPModule):
        raise ValueError(f"{what}: {type(module).__name__} is not a fully_shard module; call fully_shard on it first")
    return module._hp_fsdp_state


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params=None):
    """Shard ``module``'s parameters over the data-parallel ``mesh`` (PyTorch 2.13 FSDP2 semantics).

    Args:
        module: an ``nn.Module`` (or a list of them, sharing one group).
        mesh: 1-D mesh (FSDP) or 2-D ``(replicate, shard)`` mesh (HSDP); default: the whole world, 1-D.
            When the parameters are already DTensors on another dim of the same root mesh (TP),
            they get a 2-D (or 3-D) layout: the dp shard inside their TP placement.
        reshard_after_forward: ``True`` frees the unsharded parameters after forward (all_gather again
            in backward), ``False`` keeps them until after backward, an ``int`` is treated as ``True``
            (no smaller process group on CPU), ``None`` means ``True`` except for the root module.
        shard_placement_fn: ``param -> Shard(d)`` or ``None`` (``Shard(0)``) per parameter.
        mp_policy: :class:`MixedPrecisionPolicy`.
        offload_policy: :class:`OffloadPolicy` / :class:`CPUOffloadPolicy`.
        ignored_params: parameters left alone (not sharded, not reduced).
    Returns:
        ``module``, whose class is now a subclass of :class:`FSDPModule`.
    """
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(f"fully_shard: reshard_after_forward must be None, a bool or an int, got "
                         f"{reshard_after_forward!r}")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dt = getattr(mp_policy, field)
        if dt is not None and not getattr(dt, "is_floating_point", False):
            raise ValueError(f"fully_shard: MixedPrecisionPolicy.{field}={dt!r} is not a floating dtype")
    return _impl().fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                               shard_placement_fn=shard_placement_fn, mp_policy=mp_policy,
                               offload_policy=offload_policy, ignored_params=ignored_params,
                               module_cls=FSDPModule)
