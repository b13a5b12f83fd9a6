"""HyperParallel's DeviceMesh surface, as a mixin of our :class:`DeviceMesh`.

HyperParallel programs read meshes through names that differ from ours
(``mesh.rank``, ``axis_id``, ``get_rank_list_along_axis``...). Imports only the
coordinate arithmetic (:mod:`._coords`), so ``device_mesh.py`` can use it without
reaching the layout classes. (The Layout surface is :mod:`.layout_hp_methods`.)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

from hyper_parallel.dtensor.mesh_coords import coordinate_of


def _ranks_along(mesh_shape: Sequence[int], rank_list: Sequence[int], mesh_dim: int, rank: int) -> List[int]:
    if rank not in rank_list:
        raise ValueError(f"rank {rank} is not in the mesh's ranks {tuple(rank_list)}")
    coord = list(coordinate_of(rank_list.index(rank), mesh_shape))
    out = []
    for v in range(mesh_shape[mesh_dim]):
        coord[mesh_dim] = v
        idx = 0
        for s, c in zip(mesh_shape, coord):
            idx = idx * s + c
        out.append(rank_list[idx])
    return out



class DeviceMeshCompatMixin:
    """HyperParallel names on :class:`~hyper_parallel.dtensor.device_mesh.DeviceMesh`."""

    # what the methods read of the DeviceMesh they are mixed into (set by its __init__)
    rank_list: Tuple[int, ...]
    _rank: int
    _shape: Tuple[int, ...]
    _names: Optional[Tuple[str, ...]]
    _root: Any

    if TYPE_CHECKING:
        @property
        def ndim(self) -> int: ...

        def _dim_index(self, dim: Union[int, str]) -> int: ...

        def get_group(self, mesh_dim: Union[int, str, None] = None) -> Any: ...

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self._rank

    @property
    def mesh_shape(self) -> Tuple[int, ...]:
        return self._shape

    @property
    def root_mesh(self) -> Optional[DeviceMeshCompatMixin]:
        """The mesh this one was sliced from, or None for a root mesh."""
        return None if self._root is self else self._root

    def _hp_axis(self, axis: str, what: str) -> int:
        if not self._names:
            raise RuntimeError(f"DeviceMesh.{what}: the mesh has no mesh_dim_names")
        if axis not in self._names:
            raise ValueError(f"DeviceMesh.{what}: axis {axis!r} is not a mesh dim name; names are {self._names}")
        return self._names.index(axis)

    def axis_index(self, axis: str) -> int:
        """Position of mesh dim ``axis`` (0 = outermost)."""
        return self._hp_axis(axis, "axis_index")

    def axis_id(self, axis: str) -> int:
        """HyperParallel's reversed index of ``axis`` (0 = innermost mesh dim; ``"None"`` -> -1)."""
        if axis == "None":
            return -1
        return self.ndim - 1 - self._hp_axis(axis, "axis_id")

    def get_device_num_along_axis(self, axis: str) -> int:
        return self._shape[self._hp_axis(axis, "get_device_num_along_axis")]

    def get_rank_list_along_axis(self, axis: str) -> List[int]:
        """The ranks of this rank's group along ``axis``."""
        return _ranks_along(self._shape, self.rank_list, self._hp_axis(axis, "get_rank_list_along_axis"), self._rank)

    def get_devices_for_axis(self, axis: Union[str, int], rank: int) -> List[int]:
        """The ranks of ``rank``'s group along ``axis`` (a name or index)."""
        d = self._dim_index(axis)
        return _ranks_along(self._shape, self.rank_list, d, rank)

    def get_comm_group_by_axis(self, axis: Union[str, int, None]) -> Any:
        """The framework process group along ``axis`` (a name or index)."""
        return self.get_group(axis if axis is not None else 0)

    def get_global_shape(self, slice_shape: Sequence[int],
                         tensor_map: Optional[Sequence[Union[int, Tuple[int, ...]]]]) -> Tuple[int, ...]:
        """Global shape from a slice shape and a HyperParallel tensor map (even shards)."""
        if tensor_map is None:
            raise ValueError("DeviceMesh.get_global_shape: tensor_map is None; build a tensor layout first")
        if len(slice_shape) != len(tensor_map):
            raise ValueError(f"DeviceMesh.get_global_shape: slice_shape {tuple(slice_shape)} and tensor_map "
                             f"{tuple(tensor_map)} differ in length")
        out = []
        for s, m in zip(slice_shape, tensor_map):
            for r in (m if isinstance(m, tuple) else (m,)):
                if r != -1:
                    s *= self._shape[self.ndim - 1 - r]
            out.append(s)
        return tuple(out)


__all__ = ["DeviceMeshCompatMixin"]
