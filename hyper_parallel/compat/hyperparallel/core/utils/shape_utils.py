"""HyperParallel's ``hyper_parallel.core.utils.shape_utils``: local shard shapes and offsets (pure Python).

From a global shape, a mesh and placements.

The results are the ones this library's DTensors really hold (``torch.chunk`` rules for
uneven extents, see ``hyper_parallel.dtensor.layout``).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from hyper_parallel.dtensor.device_mesh import resolve_mesh
from hyper_parallel.dtensor.dtensor import build_layout
from hyper_parallel.dtensor.layout import chunk_size_and_offset


class LocalShape(list):
    """This rank's local shape (a list of ints, HyperParallel's result) with ``global_offset`` attached.

    ``global_offset`` is the index of the shard's first element in the global tensor (PyTorch's
    second result); ``as_tuple()`` gives PyTorch's ``(local_shape, global_offset)`` pair.
    """

    def __init__(self, shape, global_offset):
        super().__init__(int(s) for s in shape)
        self.global_offset = tuple(int(o) for o in global_offset)

    def as_tuple(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        return tuple(self), self.global_offset


def compute_local_shape_and_global_offset(global_shape: Sequence[int], device_mesh, placements) -> LocalShape:
    """This rank's local shape of a tensor of ``global_shape`` laid out as ``placements`` on ``device_mesh``.

    HyperParallel's signature and result: ``placements`` are placement objects (one per mesh
    dim) or alias names (one per tensor dim); the result is the local shape as a list (pass it
    to a factory: ``torch.ones(local_shape)``). It also carries ``.global_offset``, PyTorch's
    second result (``local_shape.as_tuple()`` is PyTorch's ``(shape, offset)``). A rank outside
    the mesh gets an empty shape (zeros) with offset 0, as its DTensor holds nothing.
    """
    try:
        global_shape = tuple(int(s) for s in global_shape)
    except TypeError:
        raise TypeError(f"compute_local_shape_and_global_offset: global_shape must be a sequence of ints, got "
                        f"{global_shape!r}") from None
    mesh = resolve_mesh(device_mesh, "compute_local_shape_and_global_offset")
    layout = build_layout(mesh, placements, len(global_shape), "compute_local_shape_and_global_offset: placements")
    coord = mesh.get_coordinate()
    if coord is None:
        return LocalShape([0] * len(global_shape), [0] * len(global_shape))
    shape, offset = layout.local_shape_and_offset(global_shape, coord=tuple(coord))
    return LocalShape(shape, offset)


def compute_local_shape_and_global_offset_by_ceil_chunk(global_shape: Sequence[int], shard_dim: int,
                                                        shard_count: int, shard_rank: int
                                                        ) -> Tuple[List[int], List[int]]:
    """Local shape and global offset of piece ``shard_rank`` of ``shard_count`` along ``shard_dim``.

    Ceil-chunk geometry (``torch.chunk``): every piece has ``ceil(n / shard_count)`` elements
    until the data runs out, so trailing pieces may be smaller or empty.
    """
    shape = [int(s) for s in global_shape]
    if not -len(shape) <= shard_dim < len(shape):
        raise ValueError(f"compute_local_shape_and_global_offset_by_ceil_chunk: shard_dim={shard_dim} is out of "
                         f"range for global_shape {tuple(shape)}")
    if shard_count < 1 or not 0 <= shard_rank < shard_count:
        raise ValueError(f"compute_local_shape_and_global_offset_by_ceil_chunk: need shard_count >= 1 and "
                         f"0 <= shard_rank < shard_count, got shard_count={shard_count}, shard_rank={shard_rank}")
    shard_dim %= len(shape)
    offset = [0] * len(shape)
    shape[shard_dim], offset[shard_dim] = chunk_size_and_offset(shape[shard_dim], shard_count, shard_rank)
    return shape, offset


__all__ = ["LocalShape", "compute_local_shape_and_global_offset", "compute_local_shape_and_global_offset_by_ceil_chunk"]
