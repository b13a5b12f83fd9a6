"""``fully_shard`` and ``FSDPModule``: PyTorch FSDP2's API on hyper_parallel's DTensor.

``fully_shard(module, mesh=...)`` turns every parameter of ``module`` that is not
already managed by a ``fully_shard`` on a submodule into a DTensor sharded on
the data-parallel mesh (``Shard(0)``, uneven sizes by ``torch.chunk`` rules) and
swaps the module's class for a subclass of :class:`FSDPModule`. Those parameters
form one *group*: before the module's forward (and, when it resharded after
forward, before its backward) the group's shards are all-gathered in one flat
collective; after its backward the group's gradients are reduce-scattered in
one flat collective and averaged over the data-parallel ranks.

This module is the home of the API: it validates every argument of ``fully_shard``
(and, with :func:`plan_params`, of ``hsdp``) and plans which parameters the group
manages and on which dim each is sharded, before anything changes. The mechanics that
carry the plan out are ``param.py``, ``param_group.py`` and ``state.py`` of this package.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union, overload

from torch import nn

from hyper_parallel.fsdp import state
from hyper_parallel.fsdp.ddp import set_requires_gradient_sync as set_replicate_gradient_sync  # noqa: F401
from hyper_parallel.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.fsdp.mesh_info import ShardPlacementResult
from hyper_parallel.fsdp.spmd_mesh import DataParallelMeshDims
from hyper_parallel.fsdp.param_group import FSDPParamGroup
from hyper_parallel.fsdp.mesh_groups import MeshGroups
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Shard
from hyper_parallel.distributed import groups
import torch

#: ``shard_placement_fn``: per parameter, ``Shard(d)``, None (``Shard(0)``) or another dp mesh
ShardPlacementFn = Callable[[nn.Parameter], Union[Shard, ShardPlacementResult, None]]
#: one planned parameter: ``(fqn, [(owner module, attribute name), ...], param, shard dim, dp mesh)``
PlannedParam = Tuple[str, List[Tuple[nn.Module, str]], nn.Parameter, int, DeviceMesh]


_DEFAULT_MESH: Dict[int, DeviceMesh] = {}


def _default_mesh():
    """1-D mesh over the whole world (one per world size)."""
    from hyper_parallel.dtensor.device_mesh import init_device_mesh
    world = groups.get_world_size()
    m = _DEFAULT_MESH.get(world)
    if m is None:
        m = _DEFAULT_MESH[world] = init_device_mesh(groups.default_device_type(), (world,))
    return m


def _collect(module, ignored):
    """(fqn, owner module, attribute name, param) of parameters not managed by an FSDP submodule."""
    out = []

    def walk(module, prefix):
        for name, p in module._parameters.items():
            if p is None or id(p) in ignored:
                continue
            out.append((prefix + name, module, name, p))
        for cname, child in module._modules.items():
            if child is None or "_hp_fsdp_state" in child.__dict__:
                continue
            walk(child, prefix + cname + ".")
    walk(module, "")
    return out


def _check_param(where, fqn, param, mesh, shard_dim):
    """A parameter the group will manage: its shard dim and (for a DTensor) its mesh must fit ``mesh``."""
    from hyper_parallel.dtensor.dtensor import DTensor
    from hyper_parallel.dtensor.mesh_siblings import unify_roots
    if isinstance(param, DTensor):
        unify_roots(mesh, param.device_mesh)  # torch slices of one root mesh (torchtitan's meshes)
    root = mesh._root
    if isinstance(param, DTensor):
        tp_mesh = param.device_mesh
        if tp_mesh._root is not root or tp_mesh is root or mesh is root:
            raise ValueError(f"fully_shard({where}): parameter {fqn!r} is a DTensor on {tp_mesh} (placements "
                             f"{tuple(param.placements)}); the fully_shard mesh {mesh} must be another dim "
                             f"of the same root mesh (e.g. mesh['dp'] next to mesh['tp'])")
        if set(tp_mesh._root_dims) & set(mesh._root_dims):
            raise ValueError(f"fully_shard({where}): parameter {fqn!r} is already distributed over mesh dims "
                             f"{tp_mesh.mesh_dim_names} that the fully_shard mesh {mesh} also uses")
        if param._layout.has_partial():
            raise ValueError(f"fully_shard({where}): parameter {fqn!r} has a Partial placement")
    ndim = param.dim()
    if ndim == 0:
        raise ValueError(f"fully_shard({where}): parameter {fqn!r} is 0-d; a scalar cannot be sharded "
                         "(pass it in ignored_params)")
    if not -ndim <= shard_dim < ndim:
        raise ValueError(f"fully_shard({where}): shard_placement_fn returned Shard({shard_dim}) for parameter "
                         f"{fqn!r} of shape {tuple(param.shape)}; expected -{ndim} <= dim < {ndim}")


def _module_list(module):
    """``fully_shard``'s module argument as a list: one module, or a list of disjoint modules (one group)."""
    if not isinstance(module, (list, tuple)):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"fully_shard: module must be an nn.Module or a list of them, got {type(module).__name__}")
        return [module]
    mods = list(module)
    if not mods:
        raise ValueError("fully_shard: module is an empty list; expected one or more nn.Modules to shard as one group")
    for i, m in enumerate(mods):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"fully_shard: module[{i}] must be an nn.Module, got {type(m).__name__}")
    for i, m in enumerate(mods):
        for j, o in enumerate(mods):
            if i == j:
                continue
            if m is o:
                raise ValueError(f"fully_shard: module[{i}] and module[{j}] are the same {type(m).__name__}; "
                                 "list each module once")
            if any(x is o for x in m.modules()):
                raise ValueError(f"fully_shard: module[{j}] ({type(o).__name__}) is inside module[{i}] "
                                 f"({type(m).__name__}); the modules of one group must be disjoint")
    return mods


def plan_params(module: Union[nn.Module, Sequence[nn.Module]], mesh: Optional[DeviceMesh],
                ignored_params: Optional[Iterable[nn.Parameter]],
                shard_placement_fn: Optional[ShardPlacementFn]) -> Tuple[DeviceMesh, List[PlannedParam]]:
    """Validate ``fully_shard``'s module, mesh, ignored_params and shard_placement_fn; plan the group.

    Returns ``(mesh, params)``: the resolved mesh and ``[(fqn, [(owner, attribute name), ...],
    param, shard dim, dp mesh)]`` of the parameters the module's group will manage (tied parameters
    once, with every owner); the dp mesh is ``mesh`` unless ``shard_placement_fn`` returned a
    ``ShardPlacementResult`` with another (``fsdp/mesh_info.py``). Nothing is changed, so an error
    leaves the module untouched.
    """
    mods = _module_list(module)
    where = type(module).__name__ if len(mods) == 1 and not isinstance(module, (list, tuple)) else \
        "[" + ", ".join(type(m).__name__ for m in mods) + "]"
    for m in mods:
        if "_hp_fsdp_state" in m.__dict__:
            raise RuntimeError(f"fully_shard was already applied to this {type(m).__name__} module; apply it once "
                               "per module")
    if mesh is None:
        mesh = _default_mesh()
    else:
        from hyper_parallel.dtensor.device_mesh import resolve_mesh
        mesh = resolve_mesh(mesh, f"fully_shard({where})")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard({where}): mesh must be 1-D (FSDP) or 2-D (replicate, shard) for HSDP, "
                         f"got a {mesh.ndim}-D mesh {mesh}; pass mesh['dp'] or mesh['dp_replicate', 'dp_shard']")
    ignored = set()
    if ignored_params is not None:
        own = {id(p) for m in mods for p in m.parameters()}
        for p in ignored_params:
            if id(p) not in own:
                raise ValueError(f"fully_shard({where}): ignored_params holds a parameter of shape "
                                 f"{tuple(p.shape)} that is not a parameter of this module")
            ignored.add(id(p))
    by_id: Dict[int, list] = {}
    listed = isinstance(module, (list, tuple))
    found = [(f"[{i}].{fqn}" if listed else fqn, owner, name, p)
             for i, m in enumerate(mods) for fqn, owner, name, p in _collect(m, ignored)]
    for fqn, owner, name, p in found:
        other = getattr(p, "_hp_fsdp_owner", None)
        if other is not None:
            raise ValueError(f"fully_shard({where}): parameter {fqn!r} is tied to a parameter already sharded by "
                             f"fully_shard on {other}; apply fully_shard to a module that holds every use of it "
                             "(or pass it in ignored_params)")
        by_id.setdefault(id(p), [fqn, [], p])[1].append((owner, name))
    from hyper_parallel.fsdp.mesh_info import resolve_placement
    params = []
    for fqn, owners, p in by_id.values():
        d, p_mesh = 0, mesh
        if shard_placement_fn is not None:
            # Shard(d), None or torch 2.13's ShardPlacementResult(placement, mesh_info): another dp mesh
            d, p_mesh = resolve_placement(shard_placement_fn(p), where, fqn, mesh)
        _check_param(where, fqn, p, p_mesh, d)
        params.append((fqn, owners, p, d, p_mesh))
    return mesh, params


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` finishes the all_gather."""

    def __init__(self, group: Union[FSDPParamGroup, MeshGroups, None] = None):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixin that ``fully_shard`` puts in front of a module's class (``FSDP<Class>``).

    Every method acts on this module's parameter group; ``recurse=True`` variants
    also act on ``fully_shard`` submodules.
    """

    _hp_fsdp_state: state.FSDPState  # set by fully_shard

    if TYPE_CHECKING:  # the module class this mixin is put in front of
        def modules(self) -> Iterator[nn.Module]: ...

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

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
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
        """Whether the next backward is the last one of the step (FSDP2's semantics).

        ``True`` (the default): at the end of that backward the root waits for every gradient
        reduction issued so far (this backward's and any left pending), adds the reduced rows to
        the sharded gradients and finishes stray prefetches. ``False``: the reductions this
        backward issues (with gradient sync on) are left in flight; the sharded gradients are
        complete only after a later backward with ``is_last_backward=True`` (gradient sync is
        :meth:`set_requires_gradient_sync`'s business, not this flag's)."""
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

    def set_modules_to_forward_prefetch(self, modules: Iterable[FSDPModule]) -> None:
        """All-gather these FSDP modules' groups right after this module's own, before its forward computes."""
        self._hp_fsdp_state.forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Iterable[FSDPModule]) -> None:
        """All-gather these FSDP modules' groups right after this module's own in backward."""
        self._hp_fsdp_state.backward_prefetch = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the data-parallel size.

        As in torch 2.13, only this module's own parameter groups (every dp mesh of it) take the
        factor, not ``fully_shard`` submodules: torchtitan sets it on every ``FSDPModule``."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor!r}")
        self._hp_fsdp_state.gradient_divide_factor = float(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """torch 2.13: reduce with SUM and divide afterwards. hyper_parallel always does (the divide is a
        separate ``div_`` after the SUM collective), so the flag changes nothing but is checked."""
        if not isinstance(enable, bool):
            raise ValueError(f"set_force_sum_reduction_for_comms: expected a bool, got {enable!r}")
        for g in _param_groups(self):
            g.force_sum = enable  # what set_all_reduce_hook's hook sees: sums (True) or means

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: Optional[torch.cuda.Stream] = None) -> None:
        """torch 2.13's ``FSDPModule.set_all_reduce_hook``: ``hook(reduce_output)`` runs on this module's
        reduced gradient shard (the reduce-scatter output; with native HSDP, the all-reduce output)
        after the reduction and before the sharded gradients are assigned from it; it may change the
        tensor in place (torchft all-reduces it over the replica groups). ``stream``: the CUDA stream
        to run it on (ignored on CPU); not allowed with native HSDP, as in torch."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook must be callable, got {type(hook).__name__}")
        groups = _param_groups(self)
        if len(groups) > 1:
            raise ValueError("set_all_reduce_hook is not supported with multiple param groups (from per-param "
                             "mesh via shard_placement_fn): the hook would be ambiguous across groups with "
                             "different meshes")
        for g in groups:
            if stream is not None and g.rep_group is not None and g.rep_group.size > 1:
                raise ValueError("set_all_reduce_hook: stream cannot be set when using native HSDP")
            g.all_reduce_hook = hook

    def set_post_optim_event(self, event: torch.Event) -> None:  # CUDA streams only; nothing to order on CPU
        return None


def _param_groups(module):
    """The ``FSDPParamGroup`` objects of one ``fully_shard`` module (one per dp mesh; none without parameters)."""
    group = module._hp_fsdp_state.group
    if group is None:
        return []
    return list(getattr(group, "groups", [group]))


def _state_of(module, what):
    if not isinstance(module, FSDPModule):
        raise ValueError(f"{what}: {type(module).__name__} is not a fully_shard module; call fully_shard on it first")
    return module._hp_fsdp_state


@overload
def fully_shard(module: nn.Module, *, mesh: Optional[DeviceMesh] = ...,
                reshard_after_forward: Union[bool, int, None] = ..., shard_placement_fn: Optional[ShardPlacementFn] = ...,
                mp_policy: MixedPrecisionPolicy = ..., offload_policy: OffloadPolicy = ...,
                ignored_params: Optional[Iterable[nn.Parameter]] = ...,
                dp_mesh_dims: Optional[DataParallelMeshDims] = ...) -> FSDPModule: ...


@overload
def fully_shard(module: List[nn.Module], *, mesh: Optional[DeviceMesh] = ...,
                reshard_after_forward: Union[bool, int, None] = ..., shard_placement_fn: Optional[ShardPlacementFn] = ...,
                mp_policy: MixedPrecisionPolicy = ..., offload_policy: OffloadPolicy = ...,
                ignored_params: Optional[Iterable[nn.Parameter]] = ...,
                dp_mesh_dims: Optional[DataParallelMeshDims] = ...) -> List[FSDPModule]: ...


def fully_shard(module: Union[nn.Module, List[nn.Module]], *, mesh: Optional[DeviceMesh] = None,
                reshard_after_forward: Union[bool, int, None] = None,
                shard_placement_fn: Optional[ShardPlacementFn] = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: Optional[Iterable[nn.Parameter]] = None,
                dp_mesh_dims: Optional[DataParallelMeshDims] = None) -> Union[FSDPModule, List[FSDPModule]]:
    """Shard ``module``'s parameters over the data-parallel ``mesh`` (PyTorch 2.13 FSDP2 semantics).

    Args:
        module: an ``nn.Module``, or a list of disjoint modules sharded as ONE group (one all_gather
            before the first of them runs forward, one reduce_scatter after the backward of all of
            them; torchtitan groups a stage's final norm and output this way). Each listed module
            becomes an :class:`FSDPModule` and they share one state; the list is returned.
        mesh: 1-D mesh (FSDP) or 2-D ``(replicate, shard)`` mesh (HSDP); default: the whole world, 1-D.
            When the parameters are already DTensors on another dim of the same root mesh (TP),
            they get a 2-D (or 3-D) layout: the dp shard inside their TP placement.
        reshard_after_forward: ``True`` frees the unsharded parameters after forward (all_gather again
            in backward), ``False`` keeps them until after backward, an ``int`` is treated as ``True``
            (no smaller process group on CPU), ``None`` means ``True`` except for the root module.
        shard_placement_fn: ``param -> Shard(d)`` or ``None`` (``Shard(0)``) per parameter, or
            torch 2.13's ``ShardPlacementResult(placement, mesh_info)`` to shard that parameter on
            ``mesh_info.mesh`` instead (MoE experts on the expert-data-parallel mesh): the module then
            has one parameter group per dp mesh, each gathered and reduced on its own mesh
            (``fsdp/mesh_info.py``, ``fsdp/mesh_groups.py``).
        mp_policy: :class:`MixedPrecisionPolicy`.
        offload_policy: :class:`OffloadPolicy` / :class:`CPUOffloadPolicy`.
        ignored_params: parameters left alone (not sharded, not reduced).
        dp_mesh_dims: a :class:`DataParallelMeshDims`: ``mesh`` is then the full SPMD mesh, the
            parameters are DTensors on it with ``Replicate()`` on the named dp dims (torch 2.13;
            ``hyper_parallel/fsdp/spmd_mesh.py``).
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
    if dp_mesh_dims is not None:
        from hyper_parallel.fsdp.spmd_mesh import split_spmd_mesh
        mesh = split_spmd_mesh(module, mesh, dp_mesh_dims, ignored_params=ignored_params)
    mesh, params = plan_params(module, mesh, ignored_params, shard_placement_fn)
    return state.fully_shard(module, mesh=mesh, params=params, reshard_after_forward=reshard_after_forward,
                               mp_policy=mp_policy, offload_policy=offload_policy, module_cls=FSDPModule)
