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


_MAX_DIMS = 64  # dims per shape/stride in the exchanged row (a tensor with more: ValueError on every rank)


def _parse(row):
    """(ndim, dtype code, requires_grad, local shape, global shape, stride) of one exchanged row."""
    nd, m = row[0], _MAX_DIMS
    k = min(nd, m)
    return (nd, row[1], row[2], tuple(row[3:3 + k]), tuple(row[3 + m:3 + m + k]), tuple(row[3 + 2 * m:3 + 2 * m + k]))


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
    # one fixed-width row per rank, the same size on every rank whatever its tensor (so the
    # exchange itself can never mismatch): local ndim, dtype, requires_grad, then the local
    # shape, global shape and local stride, each padded to _MAX_DIMS (the metadata PyTorch's
    # run_check compares across ranks)
    row = [local.dim(), _dtype_code(local.dtype), int(local.requires_grad)]
    for vals in (tuple(local.shape), tuple(gshape), tuple(local.stride())):
        vals = vals[:_MAX_DIMS]
        row += list(vals) + [-1] * (_MAX_DIMS - len(vals))
    table = _int_tensor(row, device=local.device).reshape(1, -1)
    for d in reversed(range(mesh.ndim)):  # innermost dim first: rows end up in row-major mesh order
        if mesh.size(d) > 1:
            table = coll.all_gather(table, 0, mesh.get_comm_group(d))
    # every rank now holds the same table and reaches the same verdict from it: each error below
    # is raised on every rank (no rank goes on to the broadcast while another has left)
    rows = [_parse(r) for r in table.tolist()]
    first = mesh.rank_list[0]
    me = mesh.get_rank()
    if any(r[0] > _MAX_DIMS for r in rows):
        raise ValueError(f"DTensor.from_local(run_check=True): a local tensor has more than {_MAX_DIMS} dims "
                         f"(this rank: {local.dim()}); pass run_check=False")
    odd_nd = [mesh.rank_list[i] for i, r in enumerate(rows) if r[0] != rows[0][0]]
    if odd_nd:
        raise ValueError(f"DTensor.from_local(run_check=True): inconsistent tensor metadata across ranks: the local "
                         f"tensors of rank(s) {odd_nd} have another number of dims than rank {first}'s "
                         f"({rows[0][0]}) (this rank: {local.dim()} dims, shape {tuple(local.shape)})")
    ref = rows[0][4]
    bad = []
    for i, r in enumerate(rows):
        want = layout.local_shape(ref, coord=coordinate_of(i, mesh.shape))
        if r[4] != ref or r[3] != tuple(want):
            bad.append(mesh.rank_list[i])
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
    odd = [mesh.rank_list[i] for i, r in enumerate(rows)
           if r[1:3] != rows[0][1:3] or (check_stride and r[5] != rows[0][5])]
    if odd:
        raise ValueError(f"DTensor.from_local(run_check=True): inconsistent tensor metadata across ranks: rank(s) "
                         f"{odd} differ from rank {first} in dtype, requires_grad"
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
