"""``build_layout``: the (cached) Layout of a tensor from a mesh and placements or alias names.

The one place where the two public spellings of a distribution (placement objects,
one per mesh dim; alias names, one per tensor dim) become a :class:`Layout`.
"""
from __future__ import annotations

from typing import Dict

from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.mesh_semantics import semantics_of
from hyper_parallel.dtensor.layout import Layout, PlacementsLike, is_alias_spelling
from hyper_parallel.dtensor.placement_types import Partial, Placement

_LAYOUT_CACHE: Dict[tuple, Layout] = {}


def build_layout(mesh: DeviceMesh, placements: PlacementsLike, ndim: int, what: str = "placements") -> Layout:
    """Layout for an ``ndim``-d tensor from placement objects or alias names (cached)."""
    if isinstance(placements, Layout):
        return placements
    try:
        key: tuple = (mesh, tuple(placements), ndim)
        if len(key[1]) > mesh.ndim:  # too long: the answer depends on the mesh's semantics (trim_placements)
            key += (semantics_of(mesh),)
        hit = _LAYOUT_CACHE.get(key)
    except TypeError:
        raise TypeError(f"{what}: expected a sequence of Placement objects or alias names, got {placements!r}") from None
    if hit is not None:
        return hit
    base = mesh._base_layout if hasattr(mesh, "_base_layout") else None
    if base is None:
        base = Layout.from_device_mesh(mesh)
        mesh._base_layout = base
    placements = tuple(semantics_of(mesh).trim_placements(mesh, placements, what))  # HyperParallel's: extras ignored
    if is_alias_spelling(placements):
        if mesh.mesh_dim_names is None:
            raise ValueError(f"{what}: alias names {placements} need a mesh with mesh_dim_names")
        if len(placements) != ndim:
            raise ValueError(f"{what}: alias placements {placements} have {len(placements)} entries but the tensor "
                             f"has {ndim} dims; give one alias per tensor dim")
        layout = base.with_aliases(placements)
    else:
        has_alias = any(isinstance(p, (str, tuple)) for p in placements)
        if has_alias and any(isinstance(p, Partial) for p in placements):
            raise ValueError(f"{what}: Partial cannot be written as an alias ({placements!r}); pass placement "
                             "objects, one per mesh dim, e.g. [Partial(), Replicate()]")
        for i, p in enumerate(placements):
            if not isinstance(p, Placement):
                if isinstance(p, str) or (isinstance(p, tuple) and p and isinstance(p[0], str)):
                    raise TypeError(f"{what}: do not mix alias names and placement objects ({placements!r})")
                raise TypeError(f"{what}[{i}] = {p!r} is not a Placement (Shard, Replicate, Partial) or alias name")
        layout = base.with_placements(placements, ndim)
    _LAYOUT_CACHE[key] = layout
    return layout


__all__ = ["build_layout"]
