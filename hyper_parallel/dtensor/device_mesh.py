"""DeviceMesh: an n-d arrangement of ranks with one process group per mesh dim.

Every rank builds the same mesh; the groups for every line of every mesh dim
are created once, in the same order on all ranks (``new_group`` is collective
over the world), and cached in the ground floor (``distributed/groups.py``), so sliced or re-created meshes
reuse them.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from hyper_parallel.dtensor.mesh_coords import coordinate_of
from hyper_parallel.dtensor.device_mesh_hp_methods import DeviceMeshCompatMixin
from hyper_parallel.dtensor.mesh_semantics import uses_hp_semantics  # (the mesh decides; re-exported here)
from hyper_parallel.distributed import groups
import torch

_CTX = threading.local()


def _flatten(nested):
    if hasattr(nested, "tolist"):
        nested = nested.tolist()
    if isinstance(nested, (list, tuple)):
        if nested and isinstance(nested[0], (list, tuple)):
            shape0 = len(nested)
            flat, sub = [], None
            for x in nested:
                f, s = _flatten(x)
                if sub is not None and s != sub:
                    raise ValueError(f"DeviceMesh: mesh rows have different shapes ({sub} vs {s})")
                sub = s
                flat.extend(f)
            return flat, (shape0,) + sub
        return [int(v) for v in nested], (len(nested),)
    return [int(nested)], ()


class DeviceMesh(DeviceMeshCompatMixin):
    """An n-d mesh of global ranks.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        mesh: nested list, tensor or array of global ranks; its shape is the mesh shape.
        mesh_dim_names: optional names, one per mesh dim (used for slicing and aliases).
    """

    _hp_flag: bool
    _groups: List[Any]
    _flat_meshes: Dict[str, Any]
    _foreign: Any
    _base_layout: Any  # the device-matrix Layout, made on first use (dtensor/layout_builder.py)

    def __init__(self, device_type: str, mesh: Any, *, mesh_dim_names: Optional[Sequence[str]] = None,
                 _root: Optional["DeviceMesh"] = None, _root_dims: Optional[Tuple[int, ...]] = None,
                 _init_groups: bool = True,
                 _hp_semantics: bool = False):
        flat, shape = _flatten(mesh)
        if not shape:
            raise ValueError(f"DeviceMesh: mesh must have at least one dim, got {mesh!r}")
        if len(set(flat)) != len(flat):
            raise ValueError(f"DeviceMesh: mesh {mesh!r} lists a rank more than once")
        if mesh_dim_names is not None:
            mesh_dim_names = tuple(mesh_dim_names)
            if len(mesh_dim_names) != len(shape):
                raise ValueError(f"DeviceMesh: mesh_dim_names {mesh_dim_names} has {len(mesh_dim_names)} names "
                                 f"but the mesh has {len(shape)} dims (shape {shape})")
            if len(set(mesh_dim_names)) != len(mesh_dim_names):
                raise ValueError(f"DeviceMesh: mesh_dim_names {mesh_dim_names} contains duplicates")
        self.device_type = device_type
        self.rank_list = tuple(flat)
        self._shape = tuple(shape)
        self._names = mesh_dim_names
        self._root = _root if _root is not None else self
        self._root_dims = _root_dims if _root_dims is not None else tuple(range(len(shape)))
        self._rank = groups.get_rank()
        self._coord = (coordinate_of(self.rank_list.index(self._rank), self._shape)
                       if self._rank in self.rank_list else None)
        # which library's semantics DTensors on this mesh follow (uses_hp_semantics): part of the
        # mesh's identity, so caches keyed by layouts never mix the two
        self._hp_flag = bool(_root._hp_flag) if _root is not None else bool(_hp_semantics)
        self._key = (device_type, self.rank_list, self._shape, self._names, self._hp_flag)
        self._hash = hash(self._key)
        self._groups = [None] * len(shape)
        self._flat_meshes = {}  # on a root mesh: flattened name -> (root dims, flattened mesh of this rank)
        if _init_groups:
            if groups.get_world_size() < max(flat) + 1:
                raise ValueError(f"DeviceMesh: mesh uses rank {max(flat)} but the world has only "
                                 f"{groups.get_world_size()} ranks")
            self._init_groups()

    # ------------------------------------------------------------------ groups
    def _lines(self, dims: Tuple[int, ...]):
        """All groups of ranks that vary along ``dims`` (others fixed), in a fixed order."""
        shape = self._shape
        other = [d for d in range(len(shape)) if d not in dims]
        n_other = 1
        for d in other:
            n_other *= shape[d]
        n_in = 1
        for d in dims:
            n_in *= shape[d]
        lines = []
        for o in range(n_other):
            oc = coordinate_of(o, [shape[d] for d in other])
            ranks = []
            for i in range(n_in):
                ic = coordinate_of(i, [shape[d] for d in dims])
                coord = [0] * len(shape)
                for d, c in zip(other, oc):
                    coord[d] = c
                for d, c in zip(dims, ic):
                    coord[d] = c
                idx = 0
                for d, c in enumerate(coord):
                    idx = idx * shape[d] + c
                ranks.append(self.rank_list[idx])
            lines.append(tuple(ranks))
        return lines

    def _init_groups(self):
        for d in range(len(self._shape)):
            for ranks in self._lines((d,)):
                g = groups.new_group(ranks)
                if self._rank in ranks:
                    self._groups[d] = g
                    g.name_dim(f"mesh dim {d}{' ' + repr(self._names[d]) if self._names else ''} of mesh {self._shape}")

    def _dim_index(self, dim: Union[int, str]) -> int:
        if isinstance(dim, str):
            if not self._names or dim not in self._names:
                if dim in self._root._flat_meshes:
                    raise KeyError(f"mesh dim name {dim!r} is a flattened dim; slice it alone (mesh[{dim!r}]) "
                                   f"or use its parts; this mesh's dim names are {self._names}")
                raise KeyError(f"mesh dim name {dim!r} not found; this mesh's dim names are {self._names}")
            return self._names.index(dim)
        if not isinstance(dim, int) or not -self.ndim <= dim < self.ndim:
            raise IndexError(f"mesh dim {dim!r} is out of range for a {self.ndim}-d mesh")
        return dim % self.ndim

    def get_comm_group(self, mesh_dim: Union[int, str] = 0) -> Any:
        """The :class:`CommGroup` of this rank along ``mesh_dim`` (internal collectives use it)."""
        d = self._dim_index(mesh_dim)
        g = self._groups[d]
        if g is None:
            if self._coord is None:
                raise RuntimeError(f"rank {self._rank} is not part of {self}")
            self._init_groups()
            g = self._groups[d]
        return g

    def get_group(self, mesh_dim: Union[int, str, None] = None) -> Any:
        """The framework process group along ``mesh_dim`` (torch ProcessGroup)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_group(): a {self.ndim}-d mesh needs mesh_dim")
            mesh_dim = 0
        return self.get_comm_group(mesh_dim).handle

    def get_all_groups(self) -> List[Any]:
        return [self.get_group(d) for d in range(self.ndim)]

    # ------------------------------------------------------------------ shape & coords
    @property
    def shape(self) -> Tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def mesh_dim_names(self) -> Optional[Tuple[str, ...]]:
        return self._names

    @property
    def mesh(self) -> torch.Tensor:
        """The ranks as a framework integer tensor of the mesh's shape."""
        return torch.tensor(list(self.rank_list), dtype=torch.long).reshape(tuple(self._shape))

    def _rank_index(self) -> int:
        """Position of this rank in ``rank_list`` (row-major mesh order)."""
        idx = self.__dict__.get("_my_index")
        if idx is None:
            idx = self.rank_list.index(self._rank)
            self._my_index = idx
        return idx

    def size(self, mesh_dim: Union[int, str, None] = None) -> int:
        if mesh_dim is None:
            return len(self.rank_list)
        return self._shape[self._dim_index(mesh_dim)]

    def get_rank(self) -> int:
        return self._rank

    def get_coordinate(self) -> Optional[Tuple[int, ...]]:
        return self._coord

    def get_local_rank(self, mesh_dim: Union[int, str, None] = None) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_local_rank(): a {self.ndim}-d mesh needs mesh_dim")
            mesh_dim = 0
        if self._coord is None:
            raise RuntimeError(f"rank {self._rank} is not part of {self}")
        return self._coord[self._dim_index(mesh_dim)]

    # ------------------------------------------------------------------ slicing / flattening
    def __getitem__(self, names) -> "DeviceMesh":
        if isinstance(names, (str, int)):
            names = (names,)
        flat = self._flattened(names)
        if flat is not None:
            return flat
        dims = tuple(self._dim_index(n) for n in names)
        if len(set(dims)) != len(dims):
            raise ValueError(f"mesh[{names}]: a mesh dim is named twice")
        if list(dims) != sorted(dims):
            raise ValueError(f"mesh[{names}]: dims must be given in mesh order {self._names}")
        if self._coord is None:
            raise RuntimeError(f"rank {self._rank} is not part of {self}; cannot slice it")
        if dims == tuple(range(self.ndim)):
            return self
        ranks = next(line for line in self._lines(dims) if self._rank in line)
        names_out = tuple(self._names[d] for d in dims) if self._names else None
        sub = DeviceMesh(self.device_type, _reshape(ranks, [self._shape[d] for d in dims]),
                         mesh_dim_names=names_out, _root=self._root,
                         _root_dims=tuple(self._root_dims[d] for d in dims), _init_groups=False)
        for i, d in enumerate(dims):
            sub._groups[i] = self._groups[d]
        return sub

    def _flattened(self, names):
        """The mesh flattened earlier under ``names[0]`` from dims of this mesh, if any."""
        if len(names) != 1 or not isinstance(names[0], str) or (self._names and names[0] in self._names):
            return None
        entry = self._root._flat_meshes.get(names[0])
        if entry is None or not set(entry[0]) <= set(self._root_dims):
            return None
        return entry[1]

    def _flatten(self, mesh_dim_name: Optional[str] = None) -> "DeviceMesh":
        """Merge all dims of this (sub)mesh into one; collective over the world (every rank must call).

        The result is registered on the root mesh under ``mesh_dim_name`` (default:
        the dim names joined by ``_``), so ``root[mesh_dim_name]`` returns it later;
        flattening the same dims under the same name again returns the same mesh.
        """
        root = self._root
        if mesh_dim_name is None:
            mesh_dim_name = "_".join(self._names) if self._names else "flat"
        if root._names and mesh_dim_name in root._names:
            if self._root_dims == (root._names.index(mesh_dim_name),):
                return self
            raise ValueError(f"DeviceMesh._flatten: name {mesh_dim_name!r} is already a dim of the root mesh "
                             f"(dim names {root._names}); choose another name")
        known = root._flat_meshes.get(mesh_dim_name)
        if known is not None:
            if known[0] != self._root_dims:
                dims_names = [root._names[d] if root._names else d for d in known[0]]
                raise ValueError(f"DeviceMesh._flatten: name {mesh_dim_name!r} already names the flattening of "
                                 f"root dims {dims_names}; choose another name")
            return known[1]
        my_line = None
        for ranks in root._lines(self._root_dims):
            g = groups.new_group(ranks)
            if self._rank in ranks:
                my_line = (ranks, g)
                g.name_dim(f"flattened mesh dim {mesh_dim_name!r} of mesh {root._shape}")
        assert my_line is not None, "every rank of a mesh lies on one line of each flattening"
        flat = DeviceMesh(self.device_type, list(my_line[0]), mesh_dim_names=(mesh_dim_name,), _init_groups=False,
                          _hp_semantics=uses_hp_semantics(root))
        flat._groups[0] = my_line[1]
        root._flat_meshes[mesh_dim_name] = (self._root_dims, flat)
        return flat

    flatten = _flatten

    # ------------------------------------------------------------------ context
    def __enter__(self):
        stack = getattr(_CTX, "stack", None)
        if stack is None:
            stack = _CTX.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _CTX.stack.pop()

    # ------------------------------------------------------------------ dunder
    def __eq__(self, other):
        if not isinstance(other, DeviceMesh):
            other = adopt_foreign_mesh(other)
        return isinstance(other, DeviceMesh) and self._key == other._key

    def __hash__(self):
        return self._hash

    def to_hash(self) -> int:
        return self._hash

    def __reduce__(self):
        # what identifies the mesh, not its process groups (see _rebuild_mesh)
        return (_rebuild_mesh, (self.device_type, self.rank_list, self._shape, self._names, self._hp_flag))

    def __repr__(self):
        names = f", mesh_dim_names={self._names}" if self._names else ""
        return f"DeviceMesh('{self.device_type}', {_reshape(self.rank_list, self._shape)}{names})"


def _reshape(flat, shape):
    flat = list(flat)
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0]
    return [_reshape(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def get_current_mesh() -> Optional[DeviceMesh]:
    """The innermost mesh entered with ``with mesh:``, or None."""
    stack = getattr(_CTX, "stack", None)
    return stack[-1] if stack else None


_ADOPTED: "weakref.WeakKeyDictionary[Any, DeviceMesh]" = weakref.WeakKeyDictionary()


def adopt_foreign_mesh(obj: Any) -> Optional[DeviceMesh]:
    """The hyper_parallel mesh for a framework's own mesh object (``torch.distributed``'s DeviceMesh), else None.

    The result is cached per mesh object and reuses that mesh's process groups, so
    passing a torch mesh to ``distribute_tensor``, ``parallelize_module``,
    ``fully_shard`` ... runs no collective and works on ranks outside the mesh too.
    """
    if isinstance(obj, DeviceMesh) or obj is None:
        return obj
    try:
        cached = _ADOPTED.get(obj)
    except TypeError:  # not weak-referenceable / not hashable: not a mesh either
        return None
    if cached is not None:
        # an equal torch mesh (same ranks, layout, names) may sit in another root mesh than the one
        # first adopted: describe it as this one (sibling slices, mesh_siblings.py)
        f = getattr(cached, "_foreign", None)
        if f is not None and getattr(obj, "_get_root_mesh", None) is not None and f[0] is not obj._get_root_mesh():
            from hyper_parallel.dtensor.mesh_siblings import describe_torch_slice
            cached._foreign = describe_torch_slice(obj)
        return cached
    desc = groups.describe_foreign_mesh(obj)
    if desc is None:
        return None
    device_type, ranks, names, dim_groups = desc
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names, _init_groups=False)
    for d, grp in dim_groups.items():
        mesh._groups[d] = grp
    from hyper_parallel.dtensor.mesh_siblings import describe_torch_slice
    mesh._foreign = describe_torch_slice(obj)  # its place in its torch root mesh (sibling slices: fully_shard)
    _ADOPTED[obj] = mesh
    return mesh


def resolve_mesh(mesh: Optional[DeviceMesh], what: str) -> DeviceMesh:
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            adopted = adopt_foreign_mesh(mesh)
            if adopted is None:
                raise TypeError(f"{what}: device_mesh must be a hyper_parallel or torch.distributed DeviceMesh, "
                                f"got {type(mesh).__module__}.{type(mesh).__qualname__}: {mesh!r}")
            return adopted
        return mesh
    cur = get_current_mesh()
    if cur is None:  # a torch.distributed DeviceMesh used as a context manager
        cur = adopt_foreign_mesh(groups.framework_current_mesh())
    if cur is None:
        raise ValueError(f"{what}: no device_mesh given and no current mesh; pass device_mesh or use `with mesh:`")
    return cur


def _rebuild_mesh(device_type, rank_list, shape, names, hp_semantics=False):
    """Unpickle a DeviceMesh (a DTensor loaded with ``torch.load``).

    In a process that has not initialised distributed at all the mesh is rebuilt
    without process groups (to inspect a saved shard, as PyTorch allows).

    The mesh's process groups must already exist in this process: they are made by
    creating the mesh (or the mesh it was sliced from) with ``init_device_mesh`` on
    every rank before loading. Creating them here would be a collective that only
    some ranks might reach, so a missing group is an error instead of a hang.
    """
    mesh = DeviceMesh(device_type, _reshape(rank_list, shape), mesh_dim_names=names, _init_groups=False, _hp_semantics=hp_semantics)
    if not groups.is_initialized():
        # a process without torch.distributed (inspecting a checkpoint, as PyTorch allows): the
        # shard loads as rank 0's view; anything needing a collective fails when it asks for a group
        return mesh
    missing = [ranks for d in range(len(shape)) for ranks in mesh._lines((d,)) if not groups.has_group(ranks)]
    if missing:
        raise RuntimeError(
            f"loading a DTensor saved on {mesh}: this process has no process group over ranks "
            f"{list(missing[0])}; create the mesh first on every rank, e.g. "
            f"init_device_mesh({device_type!r}, {tuple(shape)}"
            + (f", mesh_dim_names={names}" if names else "") + "), then load")
    mesh._init_groups()  # every group is cached: no collective
    return mesh


def _check_shape(device_type, mesh_shape, what):
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    mesh_shape = tuple(mesh_shape)
    if not mesh_shape or any((not isinstance(s, int)) or s <= 0 for s in mesh_shape):
        raise ValueError(f"{what}: mesh_shape must be positive ints, got {mesh_shape}")
    if device_type not in ("cpu", "cuda", "npu", "meta"):
        raise ValueError(f"{what}: device_type {device_type!r} is not supported; expected 'cpu' or 'cuda'")
    n = 1
    for s in mesh_shape:
        n *= s
    return mesh_shape, n


def init_device_mesh_torch(device_type: str, mesh_shape: Sequence[int], *,
                           mesh_dim_names: Optional[Sequence[str]] = None) -> DeviceMesh:
    """PyTorch's ``init_device_mesh``: a mesh over ranks ``0..prod(mesh_shape)-1`` (row-major).

    The torch-mirrored path ``hyper_parallel.device_mesh.init_device_mesh`` is this
    function. Every rank of the world must call it (creating the groups is
    collective); a mesh smaller than the world leaves the remaining ranks outside it,
    holding empty shards of its DTensors (docs/dtensor.md). The mesh keeps PyTorch's
    semantics (:func:`uses_hp_semantics` is False).
    """
    mesh_shape, n = _check_shape(device_type, mesh_shape, "init_device_mesh")
    groups.init_process_group(device_type)
    world = groups.get_world_size()
    if n > world:
        raise ValueError(f"init_device_mesh: mesh_shape {mesh_shape} has {n} devices but the world size is {world}; "
                         "a mesh cannot be bigger than the number of processes")
    return DeviceMesh(device_type, _reshape(range(n), mesh_shape), mesh_dim_names=mesh_dim_names)


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Optional[Sequence[str]] = None, rank_list: Optional[Sequence[int]] = None,
                     init_backend: bool = True) -> DeviceMesh:
    """HyperParallel's ``init_device_mesh`` (``hyper_parallel.init_device_mesh``).

    * ``rank_list=None``: the world is cut into aligned blocks of ``prod(mesh_shape)``
      consecutive ranks and each rank gets the mesh of its own block (8 ranks, shape
      ``(2, 2)``: ranks 0-3 and 4-7 form two independent meshes). The world size must
      be a multiple of the mesh size.
    * ``rank_list``: the mesh over exactly those ranks (row-major); ranks not listed
      are outside it.
    * ``init_backend``: initialise the default process group if needed (with False
      it must already be initialised).

    Every rank of the world must call it with the same arguments: the groups of every
    block are created on every rank, in one order (``new_group`` is collective). The
    mesh, and meshes sliced from it, follow HyperParallel's semantics
    (:func:`uses_hp_semantics`, docs/migrating_from_hyperparallel.md). PyTorch's
    version is ``hyper_parallel.device_mesh.init_device_mesh``.
    """
    mesh_shape, n = _check_shape(device_type, mesh_shape, "init_device_mesh")
    if not isinstance(init_backend, bool):
        raise ValueError(f"init_device_mesh: init_backend must be a bool, got {init_backend!r}")
    if init_backend:
        groups.init_process_group(device_type)
    elif not groups.is_initialized():
        raise RuntimeError("init_device_mesh(init_backend=False): the default process group is not initialised; "
                           "call init_process_group first or pass init_backend=True")
    world = groups.get_world_size()
    if n > world:
        raise ValueError(f"init_device_mesh: mesh_shape {mesh_shape} has {n} devices but the world size is {world}; "
                         "a mesh cannot be bigger than the number of processes")
    if rank_list is not None:
        ranks = list(rank_list) if not hasattr(rank_list, "tolist") else rank_list.tolist()
        if len(ranks) != n or any(not isinstance(r, int) or not 0 <= r < world for r in ranks) \
                or len(set(ranks)) != n:
            raise ValueError(f"init_device_mesh: rank_list {list(rank_list)} must hold {n} distinct ranks in "
                             f"[0, {world}) for mesh_shape {mesh_shape}")
        return DeviceMesh(device_type, _reshape(ranks, mesh_shape), mesh_dim_names=mesh_dim_names, _hp_semantics=True)
    if world % n:
        raise ValueError(f"init_device_mesh: mesh_shape {mesh_shape} has {n} devices, which does not divide the world "
                         f"size {world}; pass rank_list= to choose the ranks, or use "
                         "hyper_parallel.device_mesh.init_device_mesh (PyTorch's: ranks 0..n-1)")
    mine = None
    for b in range(world // n):  # every block's groups, in one order on every rank
        m = DeviceMesh(device_type, _reshape(range(b * n, (b + 1) * n), mesh_shape), mesh_dim_names=mesh_dim_names,
                       _hp_semantics=True)
        if m._coord is not None:
            mine = m
    assert mine is not None, "every rank of the world lies in one block"
    return mine


class _MeshResources:
    """HyperParallel's (and PyTorch's) ``_mesh_resources``: the meshes entered with ``with mesh:``.

    A view of this module's per-thread stack, not a second one: ``mesh_stack`` is this
    thread's stack, ``get_current_mesh()`` its innermost mesh.
    """

    @property
    def mesh_stack(self) -> list:
        stack = getattr(_CTX, "stack", None)
        if stack is None:
            stack = _CTX.stack = []
        return stack

    def get_current_mesh(self) -> DeviceMesh:
        """The innermost mesh entered with ``with mesh:`` (a ``torch.distributed`` one is adopted).

        Raises ``RuntimeError`` when there is none, as PyTorch's does.
        """
        cur = get_current_mesh()
        if cur is None:
            cur = adopt_foreign_mesh(groups.framework_current_mesh())
        if cur is None:
            raise RuntimeError("No device mesh is currently active! (_mesh_resources.get_current_mesh(): enter "
                               "`with mesh:` first, or pass device_mesh= explicitly)")
        return cur

    @staticmethod
    def get_root_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
        """The mesh ``device_mesh`` was sliced from (itself if it is a root mesh)."""
        return getattr(device_mesh, "root_mesh", None) or device_mesh


_mesh_resources = _MeshResources()

__all__ = ["DeviceMesh", "init_device_mesh", "init_device_mesh_torch", "uses_hp_semantics", "get_current_mesh",
           "adopt_foreign_mesh"]

torch.serialization.add_safe_globals([_rebuild_mesh])
