"""Layout: where each piece of a tensor lives on a device mesh, and the mesh itself.

:class:`Layout` is the class programs use (``Layout((2, 2), ("dp", "tp"))("dp", "None")``,
``dt.layout``). Its math, everything a layout is and computes, lives in the torch-free
:class:`~hyper_parallel.dtensor.layout_math.LayoutMath` it extends, so that the pure
planners (``redistribute_plan``, ``cross_mesh_plan``) import no framework, which the
``pure-math`` import contract checks including indirect imports. What needs the framework
is added here:

* ``.mesh``: the layout's :class:`DeviceMesh` (a standalone layout creates it on first use),
  with HyperParallel's other names (``LayoutCompatMixin``);
* HyperParallel's placement form ``layout([Shard(0), Replicate()])``, a :class:`PlacementSpec`;
* ``dt.layout == torch.strided``: a DTensor is a strided tensor to the framework
  (docs/design.md, "DTensor.layout");
* :func:`_get_slice_tensor_by_layout`, HyperParallel's helper on tensors.

The names the math module defines (``chunk_sizes``, ``local_shape_and_offset``...) are
re-exported from their historical home here.
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple, Union

import torch

from hyper_parallel.dtensor.layout_math import (  # noqa: F401  (re-exported: their historical home)
    NONE_ALIAS, Alias, DimMap, LayoutMath, Partials, _fit_placements, chunk_size_and_offset, chunk_sizes,
    coordinate_of, is_alias_spelling, local_shape_and_offset,
)
from hyper_parallel.dtensor.placement_types import Placement
from hyper_parallel.dtensor.layout_hp_methods import LayoutCompatMixin, PlacementSpec, unit_repeat_num  # noqa: F401
from hyper_parallel.dtensor.device_mesh import DeviceMesh  # noqa: F401  (HyperParallel imports it from here)


class Layout(LayoutCompatMixin, LayoutMath):
    """Device matrix plus (optionally) how one tensor is laid out on it.

    ``Layout(mesh_shape, alias_names)`` describes the device matrix only; call it
    with one alias per tensor dim to get a tensor layout::

        base = Layout((2, 2), ("dp", "tp"))
        lay = base(("dp", "tp"), "None")     # dim 0 split over dp (outer) and tp
        lay.placements                       # (Shard(dim=0), Shard(dim=0))

    Tensor layouts are immutable and hashable, so they serve as cache keys.
    """

    # ``mesh`` is a property (LayoutCompatMixin): a standalone layout creates its mesh lazily
    __slots__ = ()

    def __call__(self, *aliases: Any) -> Union["Layout", PlacementSpec]:
        """Tensor layout from one alias per tensor dim (``"None"`` = not sharded).

        HyperParallel's placement form, ``layout([Shard(0), Replicate()])`` or
        ``layout(Shard(0), Replicate())``, gives a :class:`PlacementSpec` (placements
        on this mesh, tensor rank not yet known) that ``distribute_tensor``,
        ``DTensor.from_local`` and ``redistribute`` accept as placements.
        """
        pls = aliases[0] if len(aliases) == 1 and isinstance(aliases[0], (list, tuple)) else aliases
        if pls and all(isinstance(p, Placement) for p in pls):
            return PlacementSpec(self, tuple(pls))
        return self.with_aliases(aliases)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LayoutMath):
            return self._key == other._key
        # a DTensor is a strided tensor to the framework: ``dt.layout == torch.strided`` holds
        # (see docs/design.md, "DTensor.layout"); never equal to sparse layouts or other objects
        return other is torch.strided

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> Tuple[Any, tuple]:
        return (_rebuild_layout, self._rebuild_args())


#: what the API accepts as placements: placement objects (one per mesh dim), alias names (one per tensor
#: dim), a tensor Layout (mesh and placements in one) or HyperParallel's ``layout(placements)``
PlacementsLike = Union[Sequence[Any], Layout, PlacementSpec]


def _rebuild_layout(mesh_shape, alias_names, rank_list, dim_map, partial, hp_semantics=True, strided=None):
    return Layout(mesh_shape, alias_names, rank_list, _dim_map=dim_map, _partial=partial, _hp_semantics=hp_semantics,
                  _strided=strided)


def _get_slice_tensor_by_layout(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """HyperParallel's helper: this rank's piece of the global ``tensor`` under ``layout`` (a copy).

    The piece is what ``distribute_tensor(tensor, layout.mesh, layout)`` holds on this rank
    (``torch.chunk`` rules); pending ``Partial`` dims are ignored (every rank slices the
    value). A rank outside the layout's mesh gets an empty tensor.
    """
    if not isinstance(layout, Layout) or layout.dim_map is None:
        raise TypeError(f"_get_slice_tensor_by_layout: layout must be a tensor Layout (e.g. layout('dp', 'None')), "
                        f"got {layout!r}")
    coord = layout.mesh.get_coordinate()
    if coord is None:
        return tensor.new_empty(0)
    shape, offset = layout.local_shape_and_offset(tuple(tensor.shape), coord=tuple(coord))
    out = tensor
    for d, (n, o) in enumerate(zip(shape, offset)):
        if n != tensor.shape[d]:
            out = out.narrow(d, o, n)
    return out.clone() if out is tensor else out.contiguous()


__all__ = ["Layout", "chunk_sizes", "chunk_size_and_offset", "local_shape_and_offset", "is_alias_spelling"]
