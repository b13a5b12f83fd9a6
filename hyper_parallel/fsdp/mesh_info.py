"""Per-parameter data-parallel meshes for ``fully_shard(shard_placement_fn=...)`` (torch 2.13's names).

torch 2.13 lets ``shard_placement_fn`` return ``ShardPlacementResult(placement, mesh_info)``: the
parameter is sharded on ``mesh_info.mesh`` instead of ``fully_shard``'s mesh. torchtitan uses it to
shard MoE experts (DTensors already ``Shard(0)`` on the expert-parallel mesh) on the
expert-data-parallel mesh ``efsdp`` while the block's other parameters are sharded on ``fsdp``, in one
``fully_shard`` call. torch then builds one parameter group per process group inside the module's
one FSDP state (``_fsdp_init._init_param_group``): one all_gather and one reduce_scatter per mesh,
each group's gradients divided by its own data-parallel size unless ``set_gradient_divide_factor``
gave one factor for all of them.

This module mirrors the classes (same fields, same ``__post_init__`` checks) and ``_get_mesh_info``,
and turns whatever ``shard_placement_fn`` returned into ``(shard dim, mesh or None)`` for
``fsdp/api.py``: ours or torch's own objects (a program that imports torch's private module keeps
working), ``Shard(d)`` / ``None`` as before. Anything else raises naming the parameter and the value.
The groups themselves are ``fsdp/mesh_groups.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Tuple

from hyper_parallel.fsdp.spmd_mesh import DataParallelMeshDims

if TYPE_CHECKING:
    from hyper_parallel.dtensor.device_mesh import DeviceMesh


@dataclass
class DataParallelMeshInfo:
    """A data-parallel mesh and which of its dims shard / replicate (torch 2.13's class, same fields)."""

    mesh: Any
    shard_mesh_dim: Optional[int] = None
    replicate_mesh_dim: Optional[int] = None
    dp_mesh_dims: Optional[DataParallelMeshDims] = None
    spmd_mesh: Any = field(default=None, repr=False)
    is_spmd_mesh: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.shard_mesh_dim is None and self.replicate_mesh_dim is None:
            raise AssertionError("At least one of shard_mesh_dim and replicate_mesh_dim must not be None")
        self.is_spmd_mesh = self.dp_mesh_dims is not None


@dataclass
class FSDPMeshInfo(DataParallelMeshInfo):
    """Shard on ``mesh`` dim ``shard_mesh_dim`` (torch 2.13's class)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shard_mesh_dim is None:
            raise AssertionError("Expects non-None shard_mesh_dim")
        self.shard_mesh_size: int = self.mesh.size(self.shard_mesh_dim)
        self.shard_process_group = self.mesh.get_group(self.shard_mesh_dim)
        self.shard_mesh_rank: int = self.mesh.get_local_rank(self.shard_mesh_dim)


@dataclass
class DDPMeshInfo(DataParallelMeshInfo):
    """Replicate on ``mesh`` dim ``replicate_mesh_dim`` (torch 2.13's class)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.replicate_mesh_dim is None:
            raise AssertionError("Expects non-None replicate_mesh_dim")
        self.replicate_mesh_size: int = self.mesh.size(self.replicate_mesh_dim)
        self.replicate_process_group = self.mesh.get_group(self.replicate_mesh_dim)
        self.replicate_mesh_rank: int = self.mesh.get_local_rank(self.replicate_mesh_dim)


@dataclass
class HSDPMeshInfo(FSDPMeshInfo, DDPMeshInfo):
    """Replicate on one dim and shard on another (torch 2.13's class)."""

    def __post_init__(self) -> None:  # pylint:disable=useless-parent-delegation
        super().__post_init__()


@dataclass
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return: the shard placement and the mesh to shard on (torch 2.13)."""

    placement: Any
    mesh_info: FSDPMeshInfo


def get_mesh_info(mesh: DeviceMesh, dp_mesh_dims: Optional[DataParallelMeshDims] = None) -> DataParallelMeshInfo:
    """torch 2.13's ``_fsdp_init._get_mesh_info``: FSDP for a 1-D mesh, HSDP (replicate 0, shard 1) for 2-D.

    With ``dp_mesh_dims``, ``mesh`` is the full SPMD mesh and the dp submesh is taken from it (several
    names of one field flattened), as torch does.
    """
    if dp_mesh_dims is not None:
        from hyper_parallel.fsdp.spmd_mesh import _one_dim
        shard, rep = tuple(dp_mesh_dims.shard_names), tuple(dp_mesh_dims.replicate_names)
        if not shard:
            return DDPMeshInfo(_one_dim(mesh, rep, "_get_mesh_info"), replicate_mesh_dim=0,
                               dp_mesh_dims=dp_mesh_dims, spmd_mesh=mesh)
        if not rep:
            return FSDPMeshInfo(_one_dim(mesh, shard, "_get_mesh_info"), shard_mesh_dim=0,
                                dp_mesh_dims=dp_mesh_dims, spmd_mesh=mesh)
        if len(shard) == 1 and len(rep) == 1:
            return HSDPMeshInfo(mesh[(rep[0], shard[0])], shard_mesh_dim=1, replicate_mesh_dim=0,
                                dp_mesh_dims=dp_mesh_dims, spmd_mesh=mesh)
        raise NotImplementedError(f"_get_mesh_info: HSDP with flattened dp dims (shard={shard}, replicate={rep}) "
                                  "is not supported by hyper_parallel")
    if mesh.ndim == 1:
        return FSDPMeshInfo(mesh, shard_mesh_dim=0)
    return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)


def _named(obj, name):
    """``obj`` is ours or torch's class called ``name`` (torch's private module is never imported here)."""
    return any(c.__name__ == name for c in type(obj).__mro__)


def _is_plain_shard(placement) -> bool:
    """``Shard(d)``, ours or torch's; not a subclass such as torch's ``_StridedShard``."""
    from hyper_parallel.dtensor.placement_types import Shard
    if type(placement) is Shard:
        return True
    t = type(placement)
    return t.__name__ == "Shard" and t.__module__.startswith("torch.distributed") and isinstance(
        getattr(placement, "dim", None), int)


def _world(mesh):
    """The ranks of the root mesh ``mesh`` is a slice of (torch's root for an adopted torch mesh)."""
    foreign = getattr(mesh, "_foreign", None)
    if foreign is not None:
        return frozenset(int(r) for r in foreign[0]._rank_map.tolist())
    return frozenset(mesh._root.rank_list)


def resolve_placement(result: Any, where: str, fqn: str, default_mesh: DeviceMesh) -> Tuple[int, DeviceMesh]:
    """``shard_placement_fn``'s result for parameter ``fqn`` as ``(shard dim, dp mesh)``.

    ``None`` / ``Shard(d)`` / ``ShardPlacementResult(Shard(d) or None, mesh_info)`` (ours or torch's).
    The mesh is ``default_mesh`` unless the result names another; it is resolved to a hyper_parallel
    mesh and must be 1-D (FSDP, shard dim 0) or 2-D (HSDP: replicate dim 0, shard dim 1), as
    ``fully_shard``'s own mesh.
    """
    if result is None:
        return 0, default_mesh
    if _is_plain_shard(result):
        return result.dim, default_mesh
    if not _named(result, "ShardPlacementResult"):
        raise ValueError(f"fully_shard({where}): shard_placement_fn returned {result!r} for parameter {fqn!r}; "
                         "expected Shard(dim), ShardPlacementResult(placement, mesh_info) or None")
    pl, info = result.placement, result.mesh_info
    if pl is None:
        d = 0
    elif _is_plain_shard(pl):
        d = pl.dim
    else:
        raise ValueError(f"fully_shard({where}): shard_placement_fn returned ShardPlacementResult(placement={pl!r}) "
                         f"for parameter {fqn!r}; expected Shard(dim) or None as the placement (FSDP shards one "
                         "tensor dim evenly; _StridedShard and other placements are not FSDP placements)")
    if not _named(info, "FSDPMeshInfo"):
        raise ValueError(f"fully_shard({where}): shard_placement_fn returned a ShardPlacementResult for parameter "
                         f"{fqn!r} whose mesh_info is {type(info).__name__} ({info!r}); expected an FSDPMeshInfo "
                         "or HSDPMeshInfo (a mesh FSDP shards on)")
    if getattr(info, "dp_mesh_dims", None) is not None:
        raise NotImplementedError(f"fully_shard({where}): parameter {fqn!r}: a per-parameter mesh_info built with "
                                  f"dp_mesh_dims={info.dp_mesh_dims!r} (a full SPMD mesh) is not supported by "
                                  "hyper_parallel; pass the dp mesh itself (_get_mesh_info(dp_mesh))")
    from hyper_parallel.dtensor.device_mesh import resolve_mesh
    mesh = resolve_mesh(info.mesh, f"fully_shard({where}): ShardPlacementResult.mesh_info.mesh of parameter {fqn!r}")
    sdim, rdim = info.shard_mesh_dim, getattr(info, "replicate_mesh_dim", None)
    hsdp = _named(info, "HSDPMeshInfo")
    ok = (mesh.ndim == 1 and sdim == 0 and rdim is None and not hsdp) or \
         (mesh.ndim == 2 and sdim == 1 and rdim == 0 and hsdp)
    if not ok:
        raise ValueError(f"fully_shard({where}): parameter {fqn!r}: mesh_info {type(info).__name__}(mesh={mesh}, "
                         f"shard_mesh_dim={sdim}, replicate_mesh_dim={rdim}) is not supported; expected "
                         "FSDPMeshInfo(1-D mesh, shard_mesh_dim=0) or HSDPMeshInfo(2-D mesh, shard_mesh_dim=1, "
                         "replicate_mesh_dim=0)")
    if mesh.device_type != default_mesh.device_type:
        raise ValueError(f"fully_shard({where}): parameter {fqn!r}: mesh_info's mesh {mesh} is on device type "
                         f"{mesh.device_type!r}, fully_shard's mesh {default_mesh} on {default_mesh.device_type!r}; "
                         "expected one device type")
    if _world(mesh) != _world(default_mesh):
        raise ValueError(f"fully_shard({where}): parameter {fqn!r}: mesh_info's mesh {mesh} is not a sub-mesh of "
                         f"the root fully_shard's mesh {default_mesh} comes from (its root spans ranks "
                         f"{sorted(_world(mesh))}, the other's {sorted(_world(default_mesh))}); expected slices of "
                         "one root mesh (e.g. world._unflatten(...)['efsdp'] next to ['fsdp'])")
    if mesh.get_coordinate() is None:
        raise ValueError(f"fully_shard({where}): parameter {fqn!r}: mesh_info's mesh {mesh} does not contain this "
                         f"rank ({mesh.get_rank()}); expected a mesh every rank running fully_shard belongs to")
    return d, mesh


__all__ = ["DataParallelMeshInfo", "FSDPMeshInfo", "DDPMeshInfo", "HSDPMeshInfo", "ShardPlacementResult",
           "get_mesh_info", "resolve_placement"]
