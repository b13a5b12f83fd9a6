"""Stand-ins for private torch DTensor functions that swapped programs call (``hyper_parallel.swap``).

``torch.distributed.tensor._utils.compute_local_shape_and_global_offset(global_shape, mesh,
placements, skip_offset=False)``: torch 2.13's rules, ``_StridedShard`` included (Hugging Face
transformers' tensor parallelism and DCP-style code compute each rank's slice with it).

``torch.distributed.tensor._random.manual_seed(seed, device_mesh)``: torch 2.13's behaviour
(:func:`hyper_parallel.dtensor.random.torch_manual_seed`): on a CPU mesh random ops on DTensors draw
each local shard from the rank's default generator, as torch's do, so a torch program's
initialisation equals torch's; elsewhere the layout-independent stream seeded with ``seed``
(torch's per-shard Philox offsets are not reproduced; ``docs/torchtitan.md``, "Seeding").
"""
from __future__ import annotations

from typing import Sequence, Tuple

from hyper_parallel.dtensor.device_mesh import resolve_mesh as _resolve_mesh
from hyper_parallel.dtensor.placement_types import Partial, Replicate, Shard, _StridedShard
from hyper_parallel.dtensor.random import torch_manual_seed as _torch_manual_seed
from hyper_parallel.dtensor.strided_math import torch_local_shape_and_offset as _torch_local_shape_and_offset


def manual_seed(seed: int, device_mesh) -> None:
    """torch's ``torch.distributed.tensor._random.manual_seed`` (signature and behaviour)."""
    _torch_manual_seed(seed, device_mesh)


def _own_placement(placement, index: int):
    """Our placement for ``placement`` (ours, or torch's class of the same name)."""
    if isinstance(placement, (Shard, _StridedShard, Replicate, Partial)):
        return placement
    name = type(placement).__name__
    if name == "_StridedShard":
        return _StridedShard(placement.dim, split_factor=int(placement.split_factor))
    if name == "Shard":
        return Shard(placement.dim)
    if name == "Replicate":
        return Replicate()
    if name == "Partial":
        return Partial()
    raise TypeError(f"compute_local_shape_and_global_offset: placements[{index}] = {placement!r} is not a "
                    "placement (Shard, _StridedShard, Replicate or Partial)")


def compute_local_shape_and_global_offset(global_shape: Sequence[int], mesh, placements: Sequence,
                                          skip_offset: bool = False
                                          ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """torch's ``_utils.compute_local_shape_and_global_offset``: this rank's local shape and first global index.

    Placements are read left to right as torch does (``_StridedShard`` takes its chunk of each
    of ``split_factor`` groups); an empty piece's offset is the dim's global size; a rank
    outside ``mesh`` gets ``((0,), ())``; ``skip_offset=True`` gives ``()`` as offset.
    """
    mesh = _resolve_mesh(mesh, "compute_local_shape_and_global_offset")
    coord = mesh.get_coordinate()
    if coord is None:
        return (0,), ()
    placements = [_own_placement(p, i) for i, p in enumerate(placements)]
    if len(placements) != mesh.ndim:
        raise ValueError(f"compute_local_shape_and_global_offset: {len(placements)} placements for a "
                         f"{mesh.ndim}-d mesh {tuple(mesh.shape)}; expected one per mesh dim")
    shape, offset = _torch_local_shape_and_offset(tuple(int(s) for s in global_shape), tuple(mesh.shape),
                                                  placements, tuple(coord))
    return (shape, ()) if skip_offset else (shape, offset)


__all__ = ["manual_seed", "compute_local_shape_and_global_offset"]
