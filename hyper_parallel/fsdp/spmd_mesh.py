"""torch 2.13's ``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``.

With ``dp_mesh_dims`` the mesh is the full SPMD mesh and the parameters are DTensors on it,
``Replicate()`` on every data-parallel dim. hyper_parallel's ``fully_shard`` takes the dp mesh and
parameters on the other dims of the same root mesh, so this module translates: the dp mesh is
``mesh[replicate..., shard...]`` (several names of one field flattened into one dim, as torch
does), each DTensor parameter is re-expressed on ``mesh[other dims]`` with its placements there
(the local tensor is the same: it is replicated over the dp dims), and the group is built as usual:
the sharded parameter has the layout ``fully_shard`` gives a TP parameter next to a dp mesh, and the
unsharded parameter the module sees in forward/backward is a DTensor on the full mesh with its
original placements (``Replicate()`` on the dp dims), as in torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Tuple, Union
import torch
from torch import nn

if TYPE_CHECKING:
    from hyper_parallel.dtensor.device_mesh import DeviceMesh


@dataclass
class DataParallelMeshDims:
    """Which dims of a full SPMD mesh are data parallel (torch 2.13's class, same fields).

    ``shard``: dim name(s) FSDP shards on (several are flattened into one); ``replicate``: the HSDP
    replication dim name(s) (several are flattened). At least one must be set.
    """

    shard: Optional[Union[str, Tuple[str, ...]]] = None
    replicate: Optional[Union[str, Tuple[str, ...]]] = None

    def __post_init__(self):
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> Tuple[str, ...]:
        return () if self.shard is None else ((self.shard,) if isinstance(self.shard, str) else tuple(self.shard))

    @property
    def replicate_names(self) -> Tuple[str, ...]:
        return () if self.replicate is None else (
            (self.replicate,) if isinstance(self.replicate, str) else tuple(self.replicate))


def _one_dim(mesh, names, what):
    """``mesh[names]`` as one mesh dim (flattened when several names)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[tuple(names)]._flatten("_".join(names))


def _managed_modules(module):
    """The modules whose parameters this ``fully_shard`` manages, each once.

    As torch: the subtree of a child that ``fully_shard`` was already applied to is left out (its
    parameters are sharded already, e.g. torchtitan's per-block and embedding ``fully_shard`` before
    the root's).
    """
    out, seen = [], set()

    def walk(mod):
        if id(mod) in seen:
            return
        seen.add(id(mod))
        out.append(mod)
        for child in mod._modules.values():
            if child is not None and "_hp_fsdp_state" not in child.__dict__:
                walk(child)
    for mod in (module if isinstance(module, (list, tuple)) else [module]):
        walk(mod)
    return out


def split_spmd_mesh(module: Union[nn.Module, Sequence[nn.Module]], mesh: Optional[DeviceMesh],
                    dp_mesh_dims: DataParallelMeshDims, where: str = "fully_shard",
                    ignored_params: Optional[Iterable[nn.Parameter]] = None) -> DeviceMesh:
    """Re-express ``module``'s DTensor parameters on the non-dp dims of ``mesh``; return the dp mesh.

    Only the parameters this ``fully_shard`` will manage: not those of submodules already sharded by
    their own ``fully_shard``, nor ``ignored_params``.
    """
    from hyper_parallel.dtensor.device_mesh import resolve_mesh
    from hyper_parallel.dtensor.dtensor import DTensor
    if not isinstance(dp_mesh_dims, DataParallelMeshDims) and not (
            hasattr(dp_mesh_dims, "shard_names") and hasattr(dp_mesh_dims, "replicate_names")):
        raise TypeError(f"{where}: dp_mesh_dims must be a DataParallelMeshDims, got {type(dp_mesh_dims).__name__}")
    if mesh is None:
        raise ValueError(f"{where}: dp_mesh_dims needs mesh (the full SPMD mesh the parameters are DTensors on)")
    mesh = resolve_mesh(mesh, where)
    names = tuple(mesh.mesh_dim_names or ())
    shard, rep = tuple(dp_mesh_dims.shard_names), tuple(dp_mesh_dims.replicate_names)
    for n in shard + rep:
        if n not in names:
            raise ValueError(f"{where}: dp_mesh_dims names mesh dim {n!r}, but the mesh's dims are {names}")
    if len(set(shard + rep)) != len(shard + rep):
        raise ValueError(f"{where}: dp_mesh_dims names a mesh dim twice (shard={shard}, replicate={rep})")
    dp_idx = [names.index(n) for n in shard + rep]
    other = tuple(n for n in names if n not in shard + rep)
    if not shard:
        raise NotImplementedError(f"{where}: dp_mesh_dims with replicate only (DDP on a SPMD mesh) is not "
                                  "supported by hyper_parallel; use replicate() or give a shard dim")
    parts = ([_one_dim(mesh, rep, where)] if rep else []) + [_one_dim(mesh, shard, where)]
    if len(parts) == 2:
        if len(rep) == 1 and len(shard) == 1 and names.index(rep[0]) < names.index(shard[0]):
            dp_mesh = mesh[(rep[0], shard[0])]
        else:
            raise NotImplementedError(f"{where}: HSDP with flattened or reordered dp dims (shard={shard}, "
                                      f"replicate={rep}) is not supported by hyper_parallel yet")
    else:
        dp_mesh = parts[0]
    tp_mesh = mesh[other] if other else None
    seen = {id(p) for p in ignored_params or ()}
    managed = _managed_modules(module)
    for mod in managed:
        for pname, p in list(mod._parameters.items()):
            if p is None or not isinstance(p, DTensor):
                continue
            if id(p) in seen:
                continue
            if p.device_mesh != mesh:
                raise ValueError(f"{where}: parameter {pname!r} of {type(mod).__name__} is a DTensor on "
                                 f"{p.device_mesh}; with dp_mesh_dims every DTensor parameter must be on the "
                                 f"full mesh {mesh}")
            pls = tuple(p.placements)
            for d in dp_idx:
                if not pls[d].is_replicate():
                    raise ValueError(f"{where}: parameter {pname!r} of {type(mod).__name__} has placement "
                                     f"{pls[d]} on data-parallel mesh dim {names[d]!r}; expected Replicate()")
            local = p._local_tensor.detach()
            if tp_mesh is None:
                new = local
            else:
                keep = [pls[names.index(n)] for n in other]
                new = DTensor.from_local(local, tp_mesh, keep, shape=tuple(p.shape), stride=tuple(p.stride()))
            newp = torch.nn.Parameter(new, requires_grad=p.requires_grad)
            # a private mark: the unsharded parameter is seen on the full mesh, as torch
            newp._hp_spmd_view = (mesh, p._layout)  # type: ignore[attr-defined]
            for m2 in managed:
                for k, v in list(m2._parameters.items()):
                    if v is p:
                        m2._parameters[k] = newp
            seen.add(id(newp))
    return dp_mesh


__all__ = ["DataParallelMeshDims", "split_spmd_mesh"]
