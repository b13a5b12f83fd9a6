"""Mesh coordinate arithmetic shared by ``layout`` and ``device_mesh`` (imports nothing)."""
from __future__ import annotations

from typing import Sequence, Tuple


def coordinate_of(flat_index: int, mesh_shape: Sequence[int]) -> Tuple[int, ...]:
    """Row-major coordinate of position ``flat_index`` in a mesh of ``mesh_shape``."""
    coord = []
    for s in reversed(mesh_shape):
        coord.append(flat_index % s)
        flat_index //= s
    return tuple(reversed(coord))
