"""HyperParallel's Layout surface, as a mixin of our :class:`Layout`.

Programs written for HyperParallel read layouts through names that differ from
ours (``alias_name``, ``repeat_num()``, ``to_dict()``...). The mixin adds those
names on top of :class:`Layout` without changing what the class is: a layout
stays an immutable, hashable value. Where HyperParallel mutates a layout in place
(``set_placements``, ``reset_partial``, ``placement_to_tensor_map``) the method
here *returns* the new layout instead; the migration guide shows the one-line change.

Import direction: ``layout`` -> this module -> ``device_mesh`` (a standalone
layout's ``.mesh`` creates a mesh) and the torch-free ``layout_math``; ``device_mesh``
never imports ``layout``.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

from hyper_parallel.dtensor.device_mesh_hp_methods import _ranks_along
from hyper_parallel.dtensor.layout_math import Alias, LayoutMath
from hyper_parallel.dtensor.placement_types import Placement
from hyper_parallel.dtensor.device_mesh import DeviceMesh, _reshape
from hyper_parallel.distributed import groups
import torch

if os.environ.get("HYPER_PARALLEL_UNIT_REPEAT_NUM", "") not in ("", "0"):
    import warnings
    warnings.warn("HYPER_PARALLEL_UNIT_REPEAT_NUM is ignored: HyperParallel programs that seed "
                  "backward with 1 / layout.repeat_num() get single-process gradients without it "
                  "(docs/migrating_from_hyperparallel.md)", DeprecationWarning, stacklevel=2)


def unit_repeat_num(enabled: bool = True) -> None:
    """Deprecated no-op, kept so that programs calling it still run.

    It used to make ``Layout.repeat_num()`` return 1. HyperParallel's gradient
    convention is now reproduced on its entry points (``reduce_partial``'s backward
    sums over the reduced ranks, ``hsdp`` sums), so ``loss.backward(1 / repeat_num())``
    gives the single-process gradient as it is, and ``repeat_num()`` always returns
    the replica count.
    """
    import warnings
    warnings.warn("unit_repeat_num() has no effect any more: seeding backward with 1 / layout.repeat_num() "
                  "already gives single-process gradients (docs/migrating_from_hyperparallel.md)",
                  DeprecationWarning, stacklevel=2)


# One mesh per (shape, names, ranks): a standalone ``Layout(...)`` reuses it, so that
# touching ``layout.mesh`` on many layouts creates the process groups once.
_STANDALONE_MESHES: Dict[tuple, DeviceMesh] = {}

if TYPE_CHECKING:  # the mixin's methods read the layout they are mixed into
    _LayoutBase = LayoutMath
else:
    _LayoutBase = object


class LayoutCompatMixin(_LayoutBase):
    """HyperParallel names on :class:`~hyper_parallel.dtensor.layout.Layout`."""

    __slots__ = ()

    # ------------------------------------------------------------------ the mesh
    @property
    def mesh(self) -> DeviceMesh:
        """The :class:`DeviceMesh` this layout lives on.

        A layout made from a mesh returns that mesh. A standalone layout
        (``Layout((2, 4), ("dp", "tp"))``) gets the matching mesh over the default
        process group on first use, created once per (shape, names, ranks) and
        shared by every layout derived from it. Creating it is collective (process
        groups), so every rank must touch ``.mesh`` of the same layouts in the same
        order, as with ``init_device_mesh``.
        """
        m = self._mesh
        if m is None:
            m = _standalone_mesh(self.mesh_shape, self.alias_names, self.rank_list, self._explicit_ranks)
        return m

    # ------------------------------------------------------------------ names HyperParallel reads
    @property
    def alias_name(self) -> Tuple[str, ...]:
        """HyperParallel's name for :attr:`alias_names` (one name per mesh dim)."""
        return self.alias_names

    @property
    def alias_tensor_map(self) -> Optional[Tuple[Alias, ...]]:
        """HyperParallel's name for :attr:`alias_placements` (``None`` for a device-matrix layout)."""
        return None if self.dim_map is None else self.alias_placements

    def is_partial(self) -> bool:
        """True when a mesh dim holds a pending reduction (``Partial``)."""
        return self.has_partial()

    def get_partial_by_dev_id(self, axis: Union[str, int]) -> Optional[str]:
        """The pending reduction (``"sum"``, ``"max"``...) on mesh dim ``axis`` (a name or index), or None.

        HyperParallel's argument is a mesh-dim name, despite the method's name.
        """
        return self.partial[self._axis_index(axis)]

    def _axis_index(self, axis: Union[str, int]) -> int:
        if isinstance(axis, str):
            if axis not in self.alias_names:
                raise ValueError(f"Layout: axis {axis!r} is not a mesh dim name; names are {self.alias_names}")
            return self.alias_names.index(axis)
        if isinstance(axis, int) and not isinstance(axis, bool) and -len(self.mesh_shape) <= axis < len(self.mesh_shape):
            return axis % len(self.mesh_shape)
        raise ValueError(f"Layout: axis {axis!r} must be a mesh dim name {self.alias_names} or an index below "
                         f"{len(self.mesh_shape)}")

    def repeat_num(self) -> int:
        """How many ranks hold each piece: mesh size / product of the mesh dims that shard the tensor.

        ``Layout((2, 4), ("dp", "mp"))("dp", "None").repeat_num() == 4``. HyperParallel
        programs seed ``loss.backward(1 / loss.layout.repeat_num())`` because the backward
        of ``reduce_partial`` sums the gradient over the reduced ranks; that convention is
        reproduced here (docs/migrating_from_hyperparallel.md). Unlike HyperParallel it
        never returns -1 for a non-last pipeline stage.
        """
        self._require_tensor()
        n = 1
        for s in self.mesh_shape:
            n *= s
        used = 1
        for d in self.sharded_mesh_dims():
            used *= self.mesh_shape[d]
        return n // used

    def to_dict(self) -> dict:
        """``{"mesh_shape", "tensor_map", "interleaved_parallel", "alias_name", "rank_list"}`` (HyperParallel's keys)."""
        if self.dim_map is None:
            raise ValueError("Layout.to_dict(): this layout has no tensor map yet; call it with aliases first, "
                             "e.g. layout('dp', 'None')")
        return {"mesh_shape": self.mesh_shape, "tensor_map": self.tensor_map,
                "interleaved_parallel": "interleaved_parallel" in self.alias_names,
                "alias_name": self.alias_names, "rank_list": self.rank_list}

    def get_global_shape(self, slice_shape: Sequence[int]) -> Tuple[int, ...]:
        """Global shape from a local (slice) shape, every shard the same size."""
        return self.global_shape(tuple(slice_shape))

    def placement_to_tensor_map(self, dim: int) -> List[Union[int, Tuple[int, ...]]]:
        """Tensor map (HyperParallel convention) of this layout's placements for a ``dim``-d tensor.

        HyperParallel also stores the map in the layout; ours is immutable, so use
        the returned list, or ``layout.with_placements(layout.placements, dim)`` for
        the tensor layout.
        """
        if not isinstance(dim, int) or dim < 0:
            raise ValueError(f"placement_to_tensor_map: dim must be a non-negative int, got {dim!r}")
        return _tensor_map_list(self.with_placements(self.placements, dim))

    def set_placements(self, placements: Sequence[Placement]) -> LayoutMath:
        """A new layout with ``placements`` (HyperParallel mutates; rebind: ``lay = lay.set_placements(p)``)."""
        nd = self.ndim if self.dim_map is not None else None
        if nd is None:
            raise ValueError("Layout.set_placements(): this layout has no tensor rank; use "
                             "layout.with_placements(placements, ndim)")
        return self.with_placements(placements, nd)

    def set_partial_by_dev_axis(self, axis: Union[str, int], op: Optional[str]) -> LayoutMath:
        """A new layout with a pending ``op`` reduction on mesh dim ``axis`` (HyperParallel mutates; rebind)."""
        self._require_tensor()
        d = self._axis_index(axis)
        if op is not None and op not in ("sum", "avg", "max", "min", "prod", "all", "any"):
            raise ValueError(f"Layout.set_partial_by_dev_axis: op must be sum, avg, max, min, prod, all, any or None, "
                             f"got {op!r}")
        if d in self.sharded_mesh_dims():
            raise ValueError(f"Layout.set_partial_by_dev_axis: mesh dim {axis!r} shards the tensor; a partial mesh "
                             "dim must not shard it")
        partial = list(self.partial)
        partial[d] = op
        return self.with_dim_map(self._dims(), partial)

    def reset_partial(self) -> LayoutMath:
        """A new layout without pending reductions (HyperParallel mutates; rebind: ``lay = lay.reset_partial()``)."""
        return self.without_partial()

    def get_devices_for_axis(self, axis: Union[str, int], rank: int) -> List[int]:
        """The ranks that share every mesh coordinate with ``rank`` except the one along ``axis``."""
        return _ranks_along(self.mesh_shape, self.rank_list, self._axis_index(axis), rank)

    def get_comm_group_by_axis(self, axis: Union[str, int]) -> Any:
        """The framework process group of this rank along ``axis`` (creates the mesh if needed)."""
        return self.mesh.get_comm_group_by_axis(axis)

    def to_string(self) -> str:
        return repr(self)


class PlacementSpec:
    """HyperParallel's ``layout(placements)``: placements on a layout's mesh, tensor rank unknown.

    It iterates over its placements, so it can be passed wherever placements are
    (``distribute_tensor(x, spec.mesh, spec)``, ``DTensor.from_local``,
    ``redistribute``, a ``ShardingPlan``); :meth:`to_layout` / ``placement_to_tensor_map``
    give the tensor layout / map once the rank is known. Immutable, like layouts.
    """

    __slots__ = ("base", "placements")

    def __init__(self, base: LayoutCompatMixin, placements: Sequence[Placement]):
        self.base = base
        self.placements = tuple(placements)

    def __iter__(self):
        return iter(self.placements)

    def __len__(self):
        return len(self.placements)

    def __getitem__(self, index):
        return self.placements[index]

    def __eq__(self, other):
        return isinstance(other, PlacementSpec) and (self.base, self.placements) == (other.base, other.placements)

    def __hash__(self):
        return hash((self.base, self.placements))

    def __repr__(self):
        return f"PlacementSpec({list(self.placements)} on mesh {self.base.mesh_shape})"

    mesh = property(lambda self: self.base.mesh)
    mesh_shape = property(lambda self: self.base.mesh_shape)
    alias_name = property(lambda self: self.base.alias_names)
    rank_list = property(lambda self: self.base.rank_list)
    tensor_map = property(lambda self: None)  # as in HyperParallel until the rank is known

    def is_partial(self) -> bool:
        return any(p.is_partial() for p in self.placements)

    def to_layout(self, ndim: int) -> LayoutMath:
        """The tensor layout for an ``ndim``-d tensor."""
        return self.base.with_placements(self.placements, ndim)

    def placement_to_tensor_map(self, dim: int) -> List[Union[int, Tuple[int, ...]]]:
        return _tensor_map_list(self.to_layout(dim))


def _tensor_map_list(layout: LayoutMath) -> List[Union[int, Tuple[int, ...]]]:
    """HyperParallel's tensor map (a list) of a tensor layout."""
    tensor_map = layout.tensor_map
    if tensor_map is None:  # pragma: no cover - with_placements always gives a tensor layout
        raise ValueError(f"{layout!r} has no tensor map")
    return list(tensor_map)


def _default_device_type() -> str:
    """"cuda" when the default group runs on NCCL, else "cpu" (HyperParallel's standalone layouts use "npu")."""
    if groups.is_initialized():
        try:
            return "cuda" if str(torch.distributed.get_backend()).lower() == "nccl" else "cpu"
        except Exception:  # noqa: BLE001 - a backend without a name: the CPU path is always valid
            return "cpu"
    return "cpu"


def _standalone_mesh(mesh_shape, alias_names, rank_list, explicit_ranks):
    key = (mesh_shape, alias_names, rank_list)
    m = _STANDALONE_MESHES.get(key)
    if m is not None:
        return m
    device_type = _default_device_type()
    groups.init_process_group(device_type)
    world = groups.get_world_size()
    n = len(rank_list)
    if not explicit_ranks and n != world:
        raise ValueError(f"Layout.mesh: mesh_shape {mesh_shape} has {n} devices but the world has {world} ranks; "
                         "the product of mesh_shape must equal the number of processes (or pass rank_list)")
    if max(rank_list) >= world:
        raise ValueError(f"Layout.mesh: rank_list {rank_list} uses rank {max(rank_list)} but the world has only "
                         f"{world} ranks")
    # a Layout is HyperParallel spelling: its mesh follows HyperParallel (uses_hp_semantics)
    m = DeviceMesh(device_type, _reshape(rank_list, mesh_shape), mesh_dim_names=alias_names, _hp_semantics=True)
    _STANDALONE_MESHES[key] = m
    return m


__all__ = ["LayoutCompatMixin", "PlacementSpec", "unit_repeat_num"]
