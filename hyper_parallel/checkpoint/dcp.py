"""``torch.distributed.checkpoint`` (DCP) extension hooks for hyper_parallel's DTensor.

DCP asks a tensor-like value three questions through dunder hooks
(``torch/distributed/checkpoint/planner_helpers.py`` and ``utils.py``):

* ``__create_write_items__(fqn, obj)``: which box of the global tensor this rank
  writes, with the global size and tensor properties (saving);
* ``__create_chunk_list__()``: which box this rank wants filled (loading; DCP
  intersects it with the saved boxes, which is the resharding);
* ``__get_tensor_shard__(index)``: the plain tensor behind a box (DCP narrows it and
  reads into / writes from it in place).

Why these are enough for every layout: under our chunking rules a rank's piece of
each tensor dim is one contiguous range even when the dim is sharded over several
mesh dims (nested ``torch.chunk``), so each rank holds exactly one box, given by
``Layout.local_shape_and_offset``. Ranks that replicate a box report the same
``(fqn, offsets)`` index, and DCP's planner deduplicates equal indices, so a
replicated tensor is written once, not once per rank.

``Partial`` tensors are rejected: a pending sum is not a box of the global tensor.
Reduce first (``dtensor.reduce_partial()``); the ``hyper_parallel.checkpoint``
state-dict helpers do that for you.

``TensorProperties.create_from_tensor`` reads ``tensor.layout``, which on a DTensor of a
HyperParallel mesh is a hyper_parallel ``Layout``, not a ``torch.layout``; the properties
are therefore taken from the local (plain) tensor.
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


_BOXES: dict = {}


def _box(dt):
    """(sizes, offsets) of this rank's piece of ``dt`` as torch.Size, or None if the rank is off the mesh.

    Memoised per (layout, global shape, coordinate): DCP asks twice per tensor and save,
    and a model repeats few distinct shapes.
    """
    coord = dt._mesh.get_coordinate()
    if coord is None:
        return None
    key = (dt._layout, dt._gshape, coord)
    box = _BOXES.get(key)
    if box is None:
        sizes, offsets = dt._layout.local_shape_and_offset(tuple(dt._gshape), coord=coord)
        if len(_BOXES) > 4096:
            _BOXES.clear()
        box = _BOXES[key] = (torch.Size(sizes), torch.Size(offsets))
    return box


def _check_savable(fqn, dt):
    if dt._layout.has_partial():
        raise ValueError(
            f"torch.distributed.checkpoint: state_dict[{fqn!r}] is a DTensor with pending Partial placements "
            f"{dt._layout.placements}; a partial sum cannot be saved. Call .reduce_partial() (or redistribute to "
            "Replicate/Shard) before saving, or use hyper_parallel.checkpoint.get_state_dict, which does it")


def create_write_items(fqn: str, dt) -> list:
    """The one write item (this rank's box) of DTensor ``dt`` saved under ``fqn``."""
    _check_savable(fqn, dt)
    box = _box(dt)
    if box is None:
        return []
    sizes, offsets = box
    local = dt._local_tensor
    if tuple(local.shape) != tuple(sizes):
        raise ValueError(f"torch.distributed.checkpoint: state_dict[{fqn!r}]: the local tensor has shape "
                         f"{tuple(local.shape)} but its layout {dt._layout.placements} over global shape "
                         f"{tuple(dt._gshape)} gives this rank the box {tuple(sizes)} at {tuple(offsets)}")
    return [WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties.create_from_tensor(local),
            size=torch.Size(dt._gshape),
        ),
    )]


def create_chunk_list(dt) -> list:
    """The boxes of the global tensor this rank holds (one, or none off the mesh)."""
    box = _box(dt)
    if box is None:
        return []
    sizes, offsets = box
    return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]


def get_tensor_shard(dt, index) -> torch.Tensor:
    """The plain local tensor behind the box ``index`` names (DCP reads/writes it in place)."""
    box = _box(dt)
    if box is None or (index.offset is not None and index.offset != box[1]):
        raise ValueError(f"torch.distributed.checkpoint: rank {dt._mesh.get_rank()} holds no piece of "
                         f"{index.fqn!r} at offsets {tuple(index.offset or ())} (its piece: "
                         f"{None if box is None else (tuple(box[0]), tuple(box[1]))})")
    return dt._local_tensor
