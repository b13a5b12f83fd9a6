"""``_StridedShard`` layout math (pure Python): placements <-> ``dim_map``, and PyTorch's local pieces.

A :class:`Layout` keeps, per tensor dim, the mesh dims that shard it outer first
(``dim_map``). PyTorch writes the same thing with one placement per mesh dim read
left to right; a tensor dim sharded by a later mesh dim *outside* an earlier one
(FSDP's shard inside a TP shard) is ``_StridedShard(dim, split_factor=k)`` on the
earlier mesh dim, where ``k`` is the product of the sizes of the later mesh dims
that shard the dim outside it (``torch.distributed.fsdp``'s rule).

:func:`placements_of` writes a ``dim_map`` that way; :func:`dim_map_of` reads it
back. A ``split_factor`` that no order of the mesh dims explains (transformers'
fused ``gate_up_proj``: ``_StridedShard(0, split_factor=2)`` on a 1-D TP mesh)
is kept as is: the layout is then *residual strided* and its pieces follow
PyTorch's left-to-right rules exactly (:func:`torch_local_indices`).
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple

from hyper_parallel.dtensor.placement_types import Partial, Replicate, Shard, _StridedShard


def placements_of(dim_map, partial, mesh_shape) -> Tuple:
    """PyTorch's placements (``Shard``/``_StridedShard``/``Partial``/``Replicate``) of a ``dim_map`` layout."""
    out = [Replicate()] * len(mesh_shape)
    for d, op in enumerate(partial):
        if op is not None:
            out[d] = Partial(op)
    for t, dims in enumerate(dim_map):
        for i, d in enumerate(dims):
            sf = 1
            for outer in dims[:i]:
                if outer > d:
                    sf *= mesh_shape[outer]
            out[d] = _StridedShard(t, split_factor=sf) if sf > 1 else Shard(t)
    return tuple(out)


def dim_map_of(placements: Sequence, mesh_shape: Sequence[int], ndim: int):
    """``(dim_map, strided)`` from placements; ``strided`` is None unless some split factor is residual.

    Mesh dims are inserted from the last to the first: the outer ones of mesh dim
    ``d`` that a placement list can name are later mesh dims, and ``_StridedShard``'s
    ``split_factor`` says how many of them (their sizes multiply to it). When no
    prefix matches, the layout is residual: ``dim_map`` lists the mesh dims in mesh
    order and ``strided`` holds every mesh dim's split factor (1 for ``Shard``).
    """
    per_dim = [[] for _ in range(ndim)]
    residual = False
    factors = [1] * len(mesh_shape)
    for d in range(len(placements) - 1, -1, -1):
        p = placements[d]
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        t = p.dim % ndim
        sf = p.split_factor if isinstance(p, _StridedShard) else 1
        factors[d] = sf
        order = per_dim[t]
        prod, k = 1, 0
        while prod != sf and k < len(order):
            prod *= mesh_shape[order[k]]
            k += 1
        if prod != sf:
            residual = True
            k = 0
        order.insert(k, d)
    if not residual:
        return tuple(tuple(o) for o in per_dim), None
    mesh_ordered = tuple(tuple(sorted(o)) for o in per_dim)
    return mesh_ordered, tuple(factors)


def _chunk(size: int, num_chunks: int, index: int) -> Tuple[int, int]:
    full = -(-size // num_chunks) if size else 0
    start = min(size, full * index)
    return start, min(size, start + full)


def torch_local_indices(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence,
                        coord: Sequence[int]) -> List[Optional[List[int]]]:
    """Per tensor dim, the global indices this coordinate holds in order (None: the whole dim).

    PyTorch's left-to-right rules (``_utils._compute_local_shape_and_global_offset``):
    ``Shard`` takes chunk ``coord`` of the current piece, ``_StridedShard`` chunk
    ``coord`` of each of its ``split_factor`` groups, concatenated.
    """
    held: List[Optional[List[int]]] = [None] * len(global_shape)
    for d, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        t = p.dim % len(global_shape)
        cur = held[t] if held[t] is not None else list(range(global_shape[t]))
        if isinstance(p, _StridedShard):
            pos = p.strided_indices(len(cur), mesh_shape[d])[coord[d]]
        else:
            lo, hi = _chunk(len(cur), mesh_shape[d], coord[d])
            pos = range(lo, hi)
        held[t] = [cur[i] for i in pos]
    return held


def torch_local_shape_and_offset(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence,
                                 coord: Sequence[int]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """PyTorch's ``compute_local_shape_and_global_offset`` for one coordinate (first index; empty: the dim's size)."""
    held = torch_local_indices(global_shape, mesh_shape, placements, coord)
    shape, offset = [], []
    for n, idx in zip(global_shape, held):
        if idx is None:
            shape.append(n)
            offset.append(0)
        else:
            shape.append(len(idx))
            offset.append(idx[0] if idx else n)
    return tuple(shape), tuple(offset)


_AGREE: dict = {}


def check_torch_pieces(layout, global_shape, what: str) -> None:
    """Raise when ``layout``'s ``_StridedShard`` label would mean other pieces under torch's rules.

    A layout whose placements carry ``_StridedShard`` holds nested ``torch.chunk`` pieces (what
    FSDP over a TP/EP shard holds, torch's too); for even extents that is exactly what torch's
    left-to-right reading of the label gives. For some uneven extents it is not: explicit
    placements then raise instead of silently holding other pieces than torch would.
    """
    if layout.strided is not None or layout.is_mesh_ordered:
        return
    key = (layout, tuple(global_shape))
    if key in _AGREE:
        return
    placements = layout.placements
    dims = sorted({d for dims in layout.dim_map for d in dims})
    mesh_shape = layout.mesh_shape
    coord = [0] * len(mesh_shape)
    for sub in itertools.product(*[range(mesh_shape[d]) for d in dims]):
        for d, c in zip(dims, sub):
            coord[d] = c
        ours = layout.local_shape_and_offset(global_shape, coord=tuple(coord))
        theirs = torch_local_shape_and_offset(global_shape, mesh_shape, placements, coord)
        if ours[0] != theirs[0] or any(n and a != b for n, a, b in zip(ours[0], ours[1], theirs[1])):
            raise NotImplementedError(
                f"{what}: placements {list(placements)} on a mesh of shape {tuple(mesh_shape)} with the uneven "
                f"global shape {tuple(global_shape)}: torch's left-to-right reading of _StridedShard gives mesh "
                f"coordinate {tuple(coord)} the piece {theirs}, hyper_parallel's nested split (what FSDP over a "
                f"TP/EP shard holds) {ours}. Pad the tensor to a multiple of the sharding mesh dims' sizes or "
                "use Shard/Replicate placements")
    if len(_AGREE) > 4096:
        _AGREE.clear()
    _AGREE[key] = True


__all__ = ["placements_of", "dim_map_of", "torch_local_indices", "torch_local_shape_and_offset", "check_torch_pieces"]
