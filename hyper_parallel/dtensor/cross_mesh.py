"""``DTensor.redistribute`` onto another mesh: runs a :mod:`cross_mesh_plan` on this rank.

Called by :meth:`DTensor.redistribute` (which wraps the result) when the target mesh differs from the
source mesh (other ranks, another shape, or both). Per rank:

* outside both meshes: nothing runs; the result is a non-member DTensor (an
  empty local tensor) on the target mesh;
* on the source mesh: ``Partial`` placements are first reduced on the source
  mesh with the ordinary redistribution (to the layout the plan chose), then
  this rank sends its pieces;
* on the target mesh: it receives (or copies) its pieces; ``Partial`` target
  placements are then made locally;
* only on the source mesh: the result is a non-member DTensor (empty local
  tensor), as PyTorch gives ranks outside a DTensor's mesh.

Differentiable: the gradient goes back along the reverse plan. Every rank of
either mesh must take part in the backward pass too (a rank that is only on the
source mesh backpropagates through its empty result, e.g.
``y.to_local().sum().backward()``), because its gradient arrives by messages.
"""
from __future__ import annotations

from hyper_parallel.dtensor import cross_mesh_plan as cmp
from hyper_parallel.dtensor.redistribute import run_plan
from hyper_parallel.distributed import differentiable

_F = differentiable


def cross_mesh_local(tensor, mesh, dst_layout):
    """This rank's local tensor of ``tensor`` (a DTensor) laid out as ``dst_layout`` on ``mesh`` (another mesh).

    An empty tensor on ranks that are not on ``mesh``; the caller wraps the result.
    """
    src_mesh = tensor._mesh
    if src_mesh.device_type != mesh.device_type:
        raise ValueError(f"redistribute: the source mesh {src_mesh} has device type {src_mesh.device_type!r} but "
                         f"the target mesh {mesh} has {mesh.device_type!r}; cross-mesh redistribution needs both "
                         "meshes on the same device type (move the tensor with .to() first)")
    if dst_layout.mesh_shape != tuple(mesh.shape) or dst_layout.rank_list != tuple(mesh.rank_list):
        raise ValueError(f"redistribute: placements were given as a layout of a mesh of shape {dst_layout.mesh_shape} "
                         f"over ranks {dst_layout.rank_list}, but the target mesh is {mesh}; build the layout "
                         "from the target mesh")
    gshape = tuple(tensor._gshape)
    local = tensor._local_tensor
    plan = cmp.cross_mesh_plan(tensor._layout, dst_layout, gshape, local.element_size())
    me = src_mesh.get_rank()
    in_src = src_mesh.get_coordinate() is not None
    in_dst = mesh.get_coordinate() is not None
    if not in_src and not in_dst:
        return local.new_empty(0)
    if in_src:
        expect = tensor._layout.local_shape(gshape, coord=src_mesh.get_coordinate())
        if tuple(local.shape) != tuple(expect):
            raise ValueError(f"redistribute: rank {me}'s local tensor has shape {tuple(local.shape)} but the global "
                             f"shape {gshape} with placements {tensor._layout.placements} gives it {tuple(expect)}; the "
                             "DTensor's global shape assumption does not match its data (build it with "
                             "from_local(..., shape=...))")
        if plan.pre_steps is not None:
            local = tensor.redistribute(src_mesh, plan.pre_layout)._local_tensor
    out = _F.CrossMeshExchange.apply(local, plan.moves.program(me), plan.backward.program(me))
    if in_dst and plan.post_steps is not None:
        out = run_plan(out, plan.post_steps, mesh, mesh._rank_index())
    return out


__all__ = ["cross_mesh_local"]
