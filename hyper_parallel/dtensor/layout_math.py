"""Layout math: where each piece of a tensor lives on a device mesh (pure Python, no torch).

A layout is described per tensor dimension by the ordered tuple of mesh dims that
shard it (``dim_map``, most significant first) plus, per mesh dim, an optional
pending reduction (``partial``). Both public spellings convert to and from it:

* placements, one per mesh dim: ``[Shard(0), Replicate()]``, ``[Partial()]``;
  several ``Shard(t)`` on one tensor dim shard it in mesh-dim order, and
  ``_StridedShard(t, split_factor=k)`` on a mesh dim says that later mesh dims
  (sizes multiplying to ``k``) shard ``t`` outside it, as PyTorch writes it;
* aliases, one per tensor dim: ``("dp", "None")``, ``(("dp", "tp"), "None")``;
  a tuple shards one tensor dim over several mesh dims, first name outermost.

Uneven extents follow ``torch.chunk`` rules: with ``n`` elements over ``k`` ranks
each rank gets ``ceil(n / k)`` until the data runs out, so later ranks may hold
smaller or empty pieces.

This module holds :class:`LayoutMath`, everything a layout *is* and computes, and
imports no framework (the ``pure-math`` import contract forbids torch, directly or
through any module it imports), so the planners that read layouts stay pure too.
The class programs use, :class:`hyper_parallel.dtensor.layout.Layout`, adds what
needs the framework on top: the layout's :class:`DeviceMesh`, HyperParallel's
placement form ``layout([Shard(0)])`` and equality with ``torch.strided``.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, List, NoReturn, Optional, Sequence, Tuple, TypeVar, Union

from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard
from hyper_parallel.dtensor import strided_math
from hyper_parallel.dtensor.mesh_coords import coordinate_of

NONE_ALIAS = "None"

#: per tensor dim, the mesh dims that shard it (most significant first)
DimMap = Tuple[Tuple[int, ...], ...]
#: per mesh dim, the pending reduction ("sum", "max", ...) or None
Partials = Tuple[Optional[str], ...]
#: one tensor dim in the alias spelling: "None", a mesh dim name, or names (outermost first)
Alias = Union[str, Tuple[str, ...]]

_L = TypeVar("_L", bound="LayoutMath")


# --------------------------------------------------------------------- chunk math
def chunk_size_and_offset(size: int, num_chunks: int, index: int) -> Tuple[int, int]:
    """Extent and start of piece ``index`` when ``size`` is cut into ``num_chunks`` (torch.chunk rules)."""
    full = -(-size // num_chunks) if size else 0
    start = full * index
    if start >= size:
        return 0, size
    return min(size, start + full) - start, start


@lru_cache(maxsize=65536)
def chunk_sizes(size: int, num_chunks: int) -> Tuple[int, ...]:
    """Extents of all ``num_chunks`` pieces of ``size`` (torch.chunk rules, zeros padded in)."""
    return tuple(chunk_size_and_offset(size, num_chunks, i)[0] for i in range(num_chunks))


def local_shape_and_offset(global_shape: Sequence[int], mesh_shape: Sequence[int],
                           dim_map: Sequence[Tuple[int, ...]], coord: Sequence[int]
                           ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Local shape and global offset of the piece held at mesh coordinate ``coord``."""
    shape = list(global_shape)
    offset = [0] * len(shape)
    for t, mesh_dims in enumerate(dim_map):
        size, off = shape[t], 0
        for d in mesh_dims:
            size, start = chunk_size_and_offset(size, mesh_shape[d], coord[d])
            off += start
        shape[t], offset[t] = size, off
    return tuple(shape), tuple(offset)


# --------------------------------------------------------------------- the class
class LayoutMath:
    """Device matrix plus (optionally) how one tensor is laid out on it: the torch-free part of ``Layout``.

    ``LayoutMath(mesh_shape, alias_names)`` describes the device matrix only; a tensor
    layout is derived from it with one alias per tensor dim (:meth:`with_aliases`),
    one placement per mesh dim (:meth:`with_placements`) or a dim map. Programs use
    :class:`hyper_parallel.dtensor.layout.Layout`, the subclass that adds the mesh::

        base = Layout((2, 2), ("dp", "tp"))
        lay = base(("dp", "tp"), "None")     # dim 0 split over dp (outer) and tp
        lay.placements                       # (Shard(dim=0), Shard(dim=0))

    Tensor layouts are immutable and hashable, so they serve as cache keys. Every
    derived layout has the class of the layout it was derived from.
    """

    __slots__ = ("mesh_shape", "alias_names", "rank_list", "_mesh", "_explicit_ranks", "dim_map", "partial",
                 "strided", "_key", "_hash")

    mesh_shape: Tuple[int, ...]
    alias_names: Tuple[str, ...]
    rank_list: Tuple[int, ...]
    #: None for a layout that describes only the device matrix
    dim_map: Optional[DimMap]
    partial: Partials
    #: residual ``_StridedShard`` split factors, one per mesh dim (None: ``dim_map`` says it all)
    strided: Optional[Tuple[int, ...]]

    def __init__(self, mesh_shape: Sequence[int], alias_names: Optional[Sequence[str]] = None,
                 rank_list: Optional[Sequence[int]] = None, *, alias_name: Optional[Sequence[str]] = None,
                 mesh: Any = None, _dim_map: Optional[Sequence[Sequence[int]]] = None,
                 _partial: Optional[Sequence[Optional[str]]] = None, _hp_semantics: Optional[bool] = None,
                 _strided: Optional[Sequence[int]] = None):
        if alias_name is not None:  # HyperParallel's keyword: Layout(mesh_shape=..., alias_name=...)
            if alias_names is not None:
                raise TypeError("Layout: give alias_names or alias_name (HyperParallel's spelling), not both")
            alias_names = alias_name
        shape = tuple(int(s) for s in mesh_shape)
        if not shape or any(s <= 0 for s in shape):
            raise ValueError(f"Layout: mesh_shape must be a non-empty tuple of positive ints, got {shape}")
        if alias_names is None:
            alias_names = tuple(f"dim{i}" for i in range(len(shape)))
        names = tuple(alias_names)
        if len(names) != len(shape):
            raise ValueError(f"Layout: alias_names {names} has {len(names)} names but "
                             f"mesh_shape {shape} has {len(shape)} dims")
        for a in names:
            if not isinstance(a, str) or a == NONE_ALIAS:
                raise ValueError(f"Layout: alias name {a!r} is not allowed (must be a string other than 'None')")
        if len(set(names)) != len(names):
            raise ValueError(f"Layout: alias_names {names} contains duplicates")
        n = 1
        for s in shape:
            n *= s
        self._explicit_ranks = rank_list is not None
        ranks = tuple(range(n)) if rank_list is None else tuple(int(r) for r in rank_list)
        if len(ranks) != n:
            raise ValueError(f"Layout: rank_list has {len(ranks)} ranks, mesh_shape {shape} needs {n}")
        self.mesh_shape = shape
        self.alias_names = names
        self.rank_list = ranks
        self._mesh = mesh
        self.dim_map = None if _dim_map is None else tuple(tuple(m) for m in _dim_map)
        self.partial = tuple(_partial) if _partial is not None else (None,) * len(shape)
        # residual _StridedShard split factors, one per mesh dim (None: dim_map alone says it all);
        # see strided_math: such a layout's pieces follow PyTorch's placement rules exactly
        self.strided = tuple(int(f) for f in _strided) if _strided is not None else None
        # a standalone Layout's mesh follows HyperParallel; the semantics are part of the identity
        # so that caches keyed by layouts never hand a PyTorch-semantics mesh's answer to the other
        hp = _hp_semantics if _hp_semantics is not None else (True if mesh is None else bool(getattr(mesh, "_hp_flag", False)))
        self._key = (shape, names, ranks, self.dim_map, self.partial, self.strided, hp)
        self._hash = hash(self._key)

    # ---------------------------------------------------------------- builders
    @classmethod
    def from_device_mesh(cls: "type[_L]", mesh: Any) -> _L:
        """Device-matrix layout of a :class:`DeviceMesh` (names default to ``dim0, dim1, ...``)."""
        return cls(mesh.shape, mesh.mesh_dim_names, mesh.rank_list, mesh=mesh)

    def _derive(self: _L, dim_map: Optional[Sequence[Sequence[int]]], partial: Sequence[Optional[str]],
                strided: Optional[Sequence[int]] = None) -> _L:
        return type(self)(self.mesh_shape, self.alias_names, self.rank_list if self._explicit_ranks else None,
                          mesh=self._mesh, _dim_map=dim_map, _partial=partial, _hp_semantics=self._key[-1], _strided=strided)

    def with_aliases(self: _L, aliases: Sequence[Alias]) -> _L:
        """Tensor layout from one alias per tensor dim (``"None"``, a mesh dim name, or a tuple of names)."""
        used = set()
        dim_map = []
        for t, a in enumerate(aliases):
            names = a if isinstance(a, tuple) else (a,)
            dims = []
            for name in names:
                if isinstance(name, Placement):
                    if isinstance(name, Partial):
                        raise ValueError(
                            f"alias placements: Partial cannot be written as an alias (tensor dim {t} got {name!r}); "
                            "pass placement objects, e.g. [Partial(), Replicate()]")
                    raise TypeError(f"alias placements: tensor dim {t} got placement {name!r}; "
                                    "use either all alias names or all placement objects")
                if not isinstance(name, str):
                    raise TypeError(f"alias placements: tensor dim {t} got {name!r}; expected a mesh dim name, "
                                    f"'None' or a tuple of names (mesh dims: {self.alias_names})")
                if name == NONE_ALIAS:
                    if len(names) > 1:
                        raise ValueError(f"alias placements: 'None' cannot appear inside a tuple ({a!r})")
                    continue
                if name.lower() == "partial" and name not in self.alias_names:
                    raise ValueError(f"alias placements: Partial cannot be written as an alias (got {name!r} for "
                                     f"tensor dim {t}); pass placement objects, e.g. [Partial(), Replicate()]")
                if name not in self.alias_names:
                    raise ValueError(f"alias placements: unknown alias {name!r} for tensor dim {t}; "
                                     f"mesh dims are {self.alias_names} (or 'None')")
                if name in used:
                    raise ValueError(f"alias placements: alias {name!r} is used twice in {tuple(aliases)}; "
                                     "a mesh dim can shard at most one tensor dim once")
                used.add(name)
                dims.append(self.alias_names.index(name))
            dim_map.append(tuple(dims))
        return self._derive(dim_map, (None,) * len(self.mesh_shape))

    def with_placements(self: _L, placements: Sequence[Placement], ndim: int) -> _L:
        """Tensor layout from one placement per mesh dim for an ``ndim``-d tensor."""
        placements = tuple(placements)
        if len(placements) != len(self.mesh_shape):
            placements = _fit_placements(placements, self.mesh_shape)
        dim_map: List[List[int]] = [[] for _ in range(ndim)]
        partial: List[Optional[str]] = []
        strided = False
        for d, p in enumerate(placements):
            if isinstance(p, (Shard, _StridedShard)):
                t = p.dim
                if not -ndim <= t < ndim:
                    raise ValueError(f"placements[{d}] = {p!r}: dim {t} is out of range for a {ndim}-d tensor "
                                     f"(expected {-ndim} <= dim < {ndim})" if ndim else
                                     f"placements[{d}] = {p!r}: a 0-d tensor cannot be sharded")
                dim_map[t % ndim].append(d)
                partial.append(None)
                strided = strided or isinstance(p, _StridedShard)
            elif isinstance(p, Partial):
                partial.append(p.reduce_op)
            elif isinstance(p, Replicate):
                partial.append(None)
            else:
                raise TypeError(f"placements[{d}] = {p!r} is not a Placement (Shard, Replicate or Partial)")
        if strided:
            strided_map, factors = strided_math.dim_map_of(placements, self.mesh_shape, ndim)
            return self._derive(strided_map, partial, factors)
        return self._derive(dim_map, partial)

    def with_dim_map(self: _L, dim_map: Sequence[Sequence[int]],
                     partial: Optional[Sequence[Optional[str]]] = None) -> _L:
        """Tensor layout from a dim map (per tensor dim, the mesh dims sharding it) and optional partials."""
        return self._derive(dim_map, partial if partial is not None else (None,) * len(self.mesh_shape))

    def replicated(self: _L, ndim: Optional[int] = None) -> _L:
        """The fully replicated layout (no shards, no partials) for the same tensor rank."""
        nd = self.ndim if ndim is None else ndim
        return self._derive(((),) * nd, (None,) * len(self.mesh_shape))

    def without_partial(self: _L) -> _L:
        """This layout with every pending reduction dropped (the dim map and strides kept)."""
        return self._derive(self.dim_map, (None,) * len(self.mesh_shape), self.strided)

    def without_strided(self: _L) -> _L:
        """This layout with every residual ``_StridedShard`` mesh dim replicated (itself when there is none)."""
        factors = self.strided
        if factors is None:
            return self
        dim_map = tuple(tuple(d for d in dims if factors[d] == 1) for dims in self._dims())
        return self._derive(dim_map, self.partial)

    # ---------------------------------------------------------------- views
    def _require_tensor(self) -> None:
        if self.dim_map is None:
            _no_tensor_map()

    def _dims(self) -> DimMap:
        """The dim map of a tensor layout (a clear error for a device-matrix layout)."""
        dim_map = self.dim_map
        if dim_map is None:
            _no_tensor_map()
        return dim_map

    @property
    def ndim(self) -> int:
        return len(self._dims())

    @property
    def mesh_ndim(self) -> int:
        return len(self.mesh_shape)

    @property
    def placements(self) -> Tuple[Placement, ...]:
        """One placement per mesh dim, as PyTorch writes it.

        A tensor dim sharded by a later mesh dim outside an earlier one reports
        ``_StridedShard(dim, split_factor=k)`` on the earlier one (``k``: the sizes of
        those outer later mesh dims multiplied), ``Shard(dim)`` elsewhere.
        """
        dim_map = self._dims()
        if self.strided is None:
            return strided_math.placements_of(dim_map, self.partial, self.mesh_shape)
        out = list(strided_math.placements_of(dim_map, self.partial, self.mesh_shape))
        for d, f in enumerate(self.strided):
            if f > 1:
                out[d] = _StridedShard(out[d].dim, split_factor=f)
        return tuple(out)

    @property
    def is_strided(self) -> bool:
        """True for a residual ``_StridedShard`` layout (pieces that are not one box of the tensor)."""
        return self.strided is not None

    @property
    def alias_placements(self) -> Tuple[Alias, ...]:
        """One alias per tensor dim: ``"None"``, a name, or a tuple of names (outer first)."""
        out: List[Alias] = []
        for dims in self._dims():
            if not dims:
                out.append(NONE_ALIAS)
            elif len(dims) == 1:
                out.append(self.alias_names[dims[0]])
            else:
                out.append(tuple(self.alias_names[d] for d in dims))
        return tuple(out)

    @property
    def tensor_map(self) -> Optional[Tuple[Union[int, Tuple[int, ...]], ...]]:
        """MindSpore-style map: per tensor dim, the mesh dim counted from the right (-1 = none).

        ``None`` for a layout that describes only the device matrix (as in HyperParallel).
        """
        if self.dim_map is None:
            return None
        n = len(self.mesh_shape)
        out: List[Union[int, Tuple[int, ...]]] = []
        for dims in self.dim_map:
            if not dims:
                out.append(-1)
            elif len(dims) == 1:
                out.append(n - 1 - dims[0])
            else:
                out.append(tuple(n - 1 - d for d in dims))
        return tuple(out)

    @property
    def is_mesh_ordered(self) -> bool:
        """True when placements alone describe this layout (multi-axis shards in mesh-dim order)."""
        dim_map = self.dim_map
        if dim_map is None:
            _no_tensor_map()
        return all(list(d) == sorted(d) for d in dim_map)

    def has_partial(self) -> bool:
        """True when a mesh dim holds a pending reduction."""
        return any(p is not None for p in self.partial)

    def is_replicated(self) -> bool:
        """True when every rank holds the whole value (no shard, no pending reduction)."""
        dim_map = self.dim_map
        if dim_map is None:
            _no_tensor_map()
        return not self.has_partial() and all(not d for d in dim_map)

    def sharded_mesh_dims(self) -> Tuple[int, ...]:
        """The mesh dims that shard some tensor dim, in tensor-dim order."""
        dim_map = self.dim_map
        if dim_map is None:
            _no_tensor_map()
        return tuple(d for dims in dim_map for d in dims)

    def tensor_dim_of(self, mesh_dim: int) -> Optional[int]:
        """The tensor dim that ``mesh_dim`` shards, or None."""
        dim_map = self.dim_map
        if dim_map is None:
            _no_tensor_map()
        for t, dims in enumerate(dim_map):
            if mesh_dim in dims:
                return t
        return None

    # ---------------------------------------------------------------- shapes
    def coordinate(self, rank: int) -> Tuple[int, ...]:
        """The mesh coordinate of global ``rank`` (ValueError when it is not in the mesh)."""
        try:
            idx = self.rank_list.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in this layout's mesh (ranks {self.rank_list})") from None
        return coordinate_of(idx, self.mesh_shape)

    def local_shape_and_offset(self, global_shape: Sequence[int], rank: Optional[int] = None, *,
                               coord: Optional[Sequence[int]] = None
                               ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """Local shape and global offset held by ``rank`` (or mesh coordinate ``coord``)."""
        dim_map = self._dims()
        if len(global_shape) != len(dim_map):
            raise ValueError(f"global shape {tuple(global_shape)} has {len(global_shape)} dims but the layout "
                             f"describes {len(dim_map)}")
        if coord is None:
            if rank is None:
                raise ValueError(f"rank None is not in this layout's mesh (ranks {self.rank_list}); give rank or coord")
            coord = self.coordinate(rank)
        if self.strided is not None:
            return strided_math.torch_local_shape_and_offset(global_shape, self.mesh_shape, self.placements, coord)
        return local_shape_and_offset(global_shape, self.mesh_shape, dim_map, coord)

    def local_indices(self, global_shape: Sequence[int], *,
                      coord: Sequence[int]) -> Tuple[Optional[List[int]], ...]:
        """Per tensor dim, the global indices the piece at ``coord`` holds, in local order (None: the whole dim).

        One range per dim for every layout but a residual ``_StridedShard`` one, whose
        pieces interleave (PyTorch's rules); checkpoints and copies read it.
        """
        dim_map = self._dims()
        if self.strided is not None:
            return tuple(strided_math.torch_local_indices(global_shape, self.mesh_shape, self.placements, coord))
        shape, offset = self.local_shape_and_offset(global_shape, coord=coord)
        return tuple(None if not dims else list(range(o, o + n))
                     for dims, n, o in zip(dim_map, shape, offset))

    def local_shape(self, global_shape: Sequence[int], rank: Optional[int] = None, *,
                    coord: Optional[Sequence[int]] = None) -> Tuple[int, ...]:
        """Local shape held by ``rank`` (or mesh coordinate ``coord``)."""
        return self.local_shape_and_offset(global_shape, rank, coord=coord)[0]

    def global_shape(self, local_shape: Sequence[int]) -> Tuple[int, ...]:
        """Global shape from a local shape, assuming every shard is the same size (the even case)."""
        dim_map = self._dims()
        if len(local_shape) != len(dim_map):
            raise ValueError(f"local shape {tuple(local_shape)} has {len(local_shape)} dims but the layout "
                             f"describes {len(dim_map)}")
        out = []
        for s, dims in zip(local_shape, dim_map):
            for d in dims:
                s *= self.mesh_shape[d]
            out.append(s)
        return tuple(out)

    def is_even(self, global_shape: Sequence[int]) -> bool:
        """True when every sharded dim of ``global_shape`` divides evenly over its mesh dims."""
        dim_map = self.dim_map
        if dim_map is None:
            _no_tensor_map()
        for n, dims in zip(global_shape, dim_map):
            for d in dims:
                if n % self.mesh_shape[d]:
                    return False
                n //= self.mesh_shape[d]
        return True

    # ---------------------------------------------------------------- dunder
    def __eq__(self, other: object) -> bool:
        if isinstance(other, LayoutMath):
            return self._key == other._key
        return False

    def __hash__(self) -> int:
        return self._hash

    def _rebuild_args(self) -> tuple:
        return (self.mesh_shape, self.alias_names, self.rank_list, self.dim_map, self.partial, self._key[-1],
                self.strided)

    def __reduce__(self) -> Tuple[Any, tuple]:
        return (_rebuild_layout_math, self._rebuild_args())

    def __repr__(self) -> str:
        if self.dim_map is None:
            return f"Layout(mesh_shape={self.mesh_shape}, alias_names={self.alias_names})"
        pl = ", ".join(str(p) for p in self.placements)
        extra = "" if self.is_mesh_ordered else f", alias={self.alias_placements}"
        return f"Layout(mesh={dict(zip(self.alias_names, self.mesh_shape))}, placements=[{pl}]{extra})"


def _no_tensor_map() -> NoReturn:
    raise ValueError("this Layout describes only the device matrix; call it with aliases first, "
                     "e.g. layout('dp', 'None')")


def _fit_placements(placements: Tuple[Placement, ...], mesh_shape: Sequence[int]) -> Tuple[Placement, ...]:
    """Placements of another length than the mesh's ndim, HyperParallel-style.

    Missing trailing entries are ``Replicate()``; extra trailing entries are dropped
    when they are ``Replicate()`` (they describe no data movement). An extra Shard
    or Partial entry names a mesh dim that does not exist and raises.
    """
    mesh_ndim = len(mesh_shape)
    if len(placements) < mesh_ndim:
        return placements + (Replicate(),) * (mesh_ndim - len(placements))
    extra = placements[mesh_ndim:]
    for i, p in enumerate(extra):
        if not isinstance(p, Replicate):
            raise ValueError(f"placements {placements} has {len(placements)} entries but the mesh {mesh_shape} has "
                             f"{mesh_ndim} dims; the extra entry placements[{mesh_ndim + i}] = {p!r} is not "
                             "Replicate() (give at most one placement per mesh dim)")
    return placements[:mesh_ndim]


def _rebuild_layout_math(mesh_shape, alias_names, rank_list, dim_map, partial, hp_semantics=True, strided=None):
    return LayoutMath(mesh_shape, alias_names, rank_list, _dim_map=dim_map, _partial=partial, _hp_semantics=hp_semantics,
                      _strided=strided)


def is_alias_spelling(placements: Any) -> bool:
    """True when ``placements`` is written with alias names rather than placement objects."""
    if not placements:
        return False
    for p in placements:
        if isinstance(p, str):
            continue
        if isinstance(p, tuple) and p and all(isinstance(x, str) for x in p):
            continue
        return False
    return True


__all__ = ["LayoutMath", "chunk_sizes", "chunk_size_and_offset", "local_shape_and_offset", "is_alias_spelling",
           "coordinate_of", "NONE_ALIAS"]
