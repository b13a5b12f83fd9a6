"""``DTensor.from_local(run_check=True)``: the collective check of every rank's local tensor."""
from __future__ import annotations

from hyper_parallel.dtensor.mesh_coords import coordinate_of
from hyper_parallel.distributed import collectives
from hyper_parallel.distributed import differentiable

import torch


def _int_tensor(values, device=None):
    """1-d int64 tensor of ``values`` (metadata exchanged through collectives)."""
    return torch.tensor([int(v) for v in values], dtype=torch.long, device=device)


def _dtype_code(dtype) -> int:
    """A small integer naming ``dtype`` the same way on every rank (for the run_check table)."""
    h = 0
    for c in str(dtype):
        h = (h * 131 + ord(c)) % 1000003
    return h


def run_check(local, mesh, layout, gshape, check_stride=True):
    """Validate every rank's local shape against one global layout and sync replicated data (collective).

    Every rank's local and global shape is gathered over the mesh (one small
    all_gather per mesh dim); the global shape of the mesh's first rank is the
    reference. A rank whose shapes disagree raises a ValueError describing its
    own shape; every other rank raises one naming those ranks, so no rank is left
    waiting in a later collective. Then the data of each replicated mesh dim is
    broadcast from that dim's first rank, also when ``local`` requires grad: the
    result's gradient flows to ``local`` unchanged (as in PyTorch).
    """
    coll = collectives
    nd = len(gshape)
    # one row per rank: ndim, local shape, global shape, then dtype, requires_grad and local
    # stride (the metadata PyTorch's run_check compares across ranks)
    meta = (_dtype_code(local.dtype), int(local.requires_grad)) + tuple(local.stride())
    table = _int_tensor((nd,) + tuple(local.shape) + tuple(gshape) + meta,
                            device=local.device).reshape(1, -1)
    for d in reversed(range(mesh.ndim)):  # innermost dim first: rows end up in row-major mesh order
        if mesh.size(d) > 1:
            table = coll.all_gather(table, 0, mesh.get_comm_group(d))
    rows = [tuple(r) for r in table.tolist()]
    first = mesh.rank_list[0]
    ref = rows[0][1 + nd:1 + 2 * nd]
    bad = []
    for i, row in enumerate(rows):
        want = layout.local_shape(ref, coord=coordinate_of(i, mesh.shape))
        if row[0] != nd or row[1 + nd:1 + 2 * nd] != ref or row[1:1 + nd] != tuple(want):
            bad.append(mesh.rank_list[i])
    me = mesh.get_rank()
    if me in bad:
        want = layout.local_shape(ref, coord=mesh.get_coordinate())
        raise ValueError(f"DTensor.from_local(run_check=True): rank {me} has local shape {tuple(local.shape)} "
                         f"(global shape {tuple(gshape)}), but with placements {layout.placements} and the global "
                         f"shape {ref} of rank {first} it should have local shape {want}; pass shape= (and "
                         "stride=) for uneven shards")
    if bad:
        raise ValueError(f"DTensor.from_local(run_check=True): the local shapes of rank(s) {bad} do not match "
                         f"placements {layout.placements} with the global shape {ref} of rank {first} "
                         "(see the error raised there)")
    ref_meta = rows[0][1 + 2 * nd:]
    odd = [mesh.rank_list[i] for i, row in enumerate(rows)
           if row[1 + 2 * nd:3 + 2 * nd] != ref_meta[:2] or (check_stride and row[3 + 2 * nd:] != ref_meta[2:])]
    if odd:
        raise ValueError(f"DTensor.from_local(run_check=True): inconsistent tensor metadata across ranks: rank(s) "
                         f"{odd} differ from rank {mesh.rank_list[0]} in dtype, requires_grad"
                         + (" or stride" if check_stride else "") + f" (this rank: dtype {local.dtype}, "
                         f"requires_grad={local.requires_grad}, stride {tuple(local.stride())})")
    for d, p in enumerate(layout.placements):
        if p.is_replicate() and mesh.size(d) > 1:
            group = mesh.get_comm_group(d)
            synced = coll.broadcast(local.detach(), group, group.ranks[0])
            if not local.requires_grad:
                local = synced
            elif synced.data_ptr() != local.data_ptr():  # the source keeps its own tensor
                local = differentiable.WithValue.apply(local, synced)
    return local


__all__ = ["run_check"]
