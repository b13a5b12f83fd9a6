"""Process groups: the default group's start, one cached ``CommGroup`` per rank set, torch meshes' groups.

Why a cache: ``torch.distributed.new_group`` is collective over the whole world, so every process
must create the same groups in the same order. Meshes ask for their groups through
:func:`new_group`, which creates each rank set's group once per process and hands the same
:class:`CommGroup` to every mesh over those ranks. A torch ``DeviceMesh`` already owns one group
per dim; :func:`describe_foreign_mesh` adopts those instead of creating new ones (creating them
would be a collective that only the ranks meeting the mesh first might reach).

Every group this module creates or adopts gets the collective timeout and the failed-collective
wrapping of :mod:`.collective_guard`; :func:`release_groups` drops the references at exit so that
``destroy_process_group`` can free them (:mod:`.launch`).
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from hyper_parallel.distributed import collective_guard as _guard
from hyper_parallel.distributed.comm_group import CommGroup


_GROUPS: dict = {}  # ranks tuple -> CommGroup


def _launch():
    from hyper_parallel.distributed import launch  # process-group start and exit (restarts, teardown)
    return launch


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def default_device_type() -> str:
    """The device type of a mesh created without one (e.g. ``fully_shard``'s default mesh)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_device(device_type: str):
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def init_process_group(device_type: str = "cpu", timeout_s: Optional[float] = None) -> None:
    """Initialise the default group from torchrun-style env vars if needed."""
    if is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"torch.distributed is not initialised and the environment lacks {missing}; "
            "launch with torchrun or call torch.distributed.init_process_group first")
    # restart-safe under torchrun's shared agent store, and groups destroyed at exit (launch.py);
    # the one collective timeout (collective_errors.collective_timeout: HYPER_PARALLEL_COLLECTIVE_TIMEOUT, setter)
    _launch().init_default_group(backend, timedelta(seconds=timeout_s) if timeout_s else _guard.group_timeout(),
                                 release=release_groups)
    _guard.adopt(dist.group.WORLD, created=True)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def new_group(ranks) -> CommGroup:
    """Return the (cached) group over ``ranks`` (collective over the world on first request)."""
    ranks = tuple(int(r) for r in ranks)
    grp = _GROUPS.get(ranks)
    if grp is None:
        if ranks == tuple(range(get_world_size())):
            handle = dist.group.WORLD
            _guard.adopt(handle, created=False)
        else:
            handle = dist.new_group(list(ranks), use_local_synchronization=False, timeout=_guard.group_timeout())
            _guard.adopt(handle, created=True)
        grp = CommGroup(ranks, handle, get_rank())
        _GROUPS[ranks] = grp
        _launch().install_exit_hook(release_groups)  # once per process (launch.py)
    return grp


def has_group(ranks) -> bool:
    """Whether the group over ``ranks`` was already created (creating one is collective)."""
    ranks = tuple(int(r) for r in ranks)
    return ranks in _GROUPS or (is_initialized() and ranks == tuple(range(get_world_size())))


def reset_groups() -> None:
    _GROUPS.clear()
    _guard.forget_groups()


def release_groups() -> None:
    """Drop this module's references to process groups (at exit: launch.destroy_at_exit).

    The group cache, and through it every mesh, holds the ProcessGroup objects; while it does,
    ``dist.destroy_process_group()`` cannot free them and their gloo threads outlive it."""
    for grp in _GROUPS.values():
        grp.handle = None
    _GROUPS.clear()
    _guard.forget_groups()  # the timeout registry holds the same groups


def framework_current_mesh():
    """The mesh of the innermost ``with torch_mesh:`` block, or None (torch keeps the stack privately)."""
    try:
        from torch.distributed.device_mesh import _mesh_resources
        stack = _mesh_resources.mesh_stack
    except (ImportError, AttributeError):  # pragma: no cover - another torch layout
        return None
    return stack[-1] if stack else None


def describe_foreign_mesh(obj):
    """``(device_type, nested ranks, dim names, {dim: CommGroup})`` for a ``torch.distributed`` DeviceMesh, else None.

    A PyTorch user keeps ``torch.distributed.device_mesh.init_device_mesh`` when swapping
    the DTensor imports; that mesh already owns one process group per dim, so they
    are reused (registered in the group cache) instead of created again.
    """
    try:
        from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if not isinstance(obj, TorchMesh):
        return None
    ranks = obj.mesh.tolist()
    names = tuple(obj.mesh_dim_names) if obj.mesh_dim_names else None
    groups = {}
    if obj.get_coordinate() is not None and is_initialized():
        me = get_rank()
        coord = obj.get_coordinate()
        for d in range(obj.mesh.ndim):
            index = [slice(None) if i == d else c for i, c in enumerate(coord)]
            line = tuple(int(r) for r in obj.mesh[tuple(index)].tolist())
            grp = _GROUPS.get(line)
            if grp is None:
                grp = CommGroup(line, obj.get_group(d), me)
                _GROUPS[line] = grp
                _guard.adopt(grp.handle, created=False)
            grp.name_dim(f"mesh dim {d}{' ' + repr(names[d]) if names else ''} of torch mesh {tuple(obj.mesh.shape)}")
            groups[d] = grp
    return obj.device_type, ranks, names, groups
