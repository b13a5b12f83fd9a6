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
``Layout.local_shape_and_offset``; this covers ``_StridedShard`` placements that FSDP
produces over TP/EP shards. A *residual* ``_StridedShard`` (a split factor no mesh order
explains, e.g. transformers' fused ``gate_up_proj``) gives a rank several ranges per dim:
it writes and reads one box per combination of ranges, each a view of its local tensor
(torch's own DCP hooks write only the first one). Ranks that replicate a box report the same
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

import itertools
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


_BOXES: dict = {}
_STRIDED_BOXES: dict = {}


def _runs(idx):
    """``(local start, global start, length)`` of each run of consecutive global indices in ``idx``."""
    out = []
    for pos, g in enumerate(idx):
        if out and out[-1][1] + out[-1][2] == g:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((pos, g, 1))
    return out


def _strided_boxes(dtensor):
    """Boxes ``(sizes, offsets, local starts)`` of a residual strided DTensor's piece (see the module doc)."""
    coord = dtensor._mesh.get_coordinate()
    if coord is None:
        return []
    key = (dtensor._layout, dtensor._gshape, coord)
    boxes = _STRIDED_BOXES.get(key)
    if boxes is None:
        gshape = tuple(dtensor._gshape)
        held = dtensor._layout.local_indices(gshape, coord=coord)
        per_dim = [[(0, 0, n)] if idx is None else _runs(idx) for n, idx in zip(gshape, held)]
        boxes = [(torch.Size(r[2] for r in combo), torch.Size(r[1] for r in combo), tuple(r[0] for r in combo))
                 for combo in itertools.product(*per_dim)]
        if len(_STRIDED_BOXES) > 4096:
            _STRIDED_BOXES.clear()
        _STRIDED_BOXES[key] = boxes
    return boxes


def _box(dtensor):
    """(sizes, offsets) of this rank's piece of ``dtensor`` as torch.Size, or None if the rank is off the mesh.

    Memoised per (layout, global shape, coordinate): DCP asks twice per tensor and save,
    and a model repeats few distinct shapes.
    """
    coord = dtensor._mesh.get_coordinate()
    if coord is None:
        return None
    key = (dtensor._layout, dtensor._gshape, coord)
    box = _BOXES.get(key)
    if box is None:
        sizes, offsets = dtensor._layout.local_shape_and_offset(tuple(dtensor._gshape), coord=coord)
        if len(_BOXES) > 4096:
            _BOXES.clear()
        box = _BOXES[key] = (torch.Size(sizes), torch.Size(offsets))
    return box


def _check_savable(fqn, dtensor):
    if dtensor._layout.has_partial():
        raise ValueError(
            f"torch.distributed.checkpoint: state_dict[{fqn!r}] is a DTensor with pending Partial placements "
            f"{dtensor._layout.placements}; a partial sum cannot be saved. Call .reduce_partial() (or redistribute to "
            "Replicate/Shard) before saving, or use hyper_parallel.checkpoint.get_state_dict, which does it")


def _write_item(fqn, offsets, sizes, local, gshape):
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties.create_from_tensor(local),
            size=torch.Size(gshape),
        ),
    )


def create_write_items(fqn: str, dtensor: Any) -> list:
    """The write items (this rank's box, or boxes for a residual strided layout) of ``dtensor`` saved under ``fqn``."""
    _check_savable(fqn, dtensor)
    if dtensor._layout.is_strided:
        return [_write_item(fqn, offsets, sizes, dtensor._local_tensor, dtensor._gshape)
                for sizes, offsets, _ in _strided_boxes(dtensor) if all(sizes)]
    box = _box(dtensor)
    if box is None:
        return []
    sizes, offsets = box
    local = dtensor._local_tensor
    if tuple(local.shape) != tuple(sizes):
        raise ValueError(f"torch.distributed.checkpoint: state_dict[{fqn!r}]: the local tensor has shape "
                         f"{tuple(local.shape)} but its layout {dtensor._layout.placements} over global shape "
                         f"{tuple(dtensor._gshape)} gives this rank the box {tuple(sizes)} at {tuple(offsets)}")
    return [_write_item(fqn, offsets, sizes, local, dtensor._gshape)]


def create_chunk_list(dtensor: Any) -> list:
    """The boxes of the global tensor this rank holds (one, or none off the mesh)."""
    if dtensor._layout.is_strided:
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for sizes, offsets, _ in _strided_boxes(dtensor)
                if all(sizes)]
    box = _box(dtensor)
    if box is None:
        return []
    sizes, offsets = box
    return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]


def get_tensor_shard(dtensor: Any, index: MetadataIndex) -> torch.Tensor:
    """The plain local tensor behind the box ``index`` names (DCP reads/writes it in place)."""
    if dtensor._layout.is_strided:
        for sizes, offsets, starts in _strided_boxes(dtensor):
            if index.offset is not None and index.offset == offsets:
                view = dtensor._local_tensor
                for d, (a, n) in enumerate(zip(starts, sizes)):
                    view = view.narrow(d, a, n)
                return view
    box = _box(dtensor)
    if box is None or (index.offset is not None and index.offset != box[1]):
        raise ValueError(f"torch.distributed.checkpoint: rank {dtensor._mesh.get_rank()} holds no piece of "
                         f"{index.fqn!r} at offsets {tuple(index.offset or ())} (its piece: "
                         f"{None if box is None else (tuple(box[0]), tuple(box[1]))})")
    return dtensor._local_tensor
