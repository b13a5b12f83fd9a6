"""Redistribution planner (pure): the cheapest sequence of collectives between two layouts.

A state is a layout's ``(dim_map, partial)``. Moves, each on one mesh dim ``d``
of size ``k`` (only the innermost shard of a tensor dim is ever gathered or
moved, which keeps every move exact under ``torch.chunk`` rules):

===============  ==============================  ==================================
move             effect on mesh dim d            bytes one rank sends
===============  ==============================  ==================================
all_reduce       Partial -> Replicate            2 * local * (k-1) / k
reduce_scatter   Partial -> Shard(t)             padded local * (k-1) / k
all_gather       Shard(t) -> Replicate           padded piece * (k-1)
all_to_all       Shard(t) -> Shard(u)            local - the piece it keeps
split            Replicate -> Shard(t)           0 (local slice)
to_partial       Replicate -> Partial            0 (local)
===============  ==============================  ==================================

Plans are found by Dijkstra on an alpha-beta cost: the largest per-rank byte
count of each move plus, for each collective, ``COLLECTIVE_LATENCY_BYTES`` (a
collective's fixed latency priced as bytes on the wire; ties broken by fewer
communicating moves, then fewer moves). So a direct collective always beats a
detour through Replicate; small tensors take the plan with the fewest
collectives (on a (2, 2, 2) mesh and 8x8x8 fp32 that is PyTorch's own plan, as
its ``test_redistribute_shard_dim_multi_dim_mesh`` counts them) and large ones
the plan that sends the fewest bytes (which can take more collectives than
PyTorch's one-mesh-dim-at-a-time plan). Plans are cached by
``(src, dst, global_shape, itemsize)``.
"""
from __future__ import annotations

import heapq
from functools import lru_cache


from hyper_parallel.dtensor.layout_math import LayoutMath, chunk_sizes, coordinate_of, local_shape_and_offset
from hyper_parallel.distributed import comm_record as rec

ALL_REDUCE = rec.ALL_REDUCE
REDUCE_SCATTER = rec.REDUCE_SCATTER
ALL_GATHER = rec.ALL_GATHER
ALL_TO_ALL = rec.ALL_TO_ALL
SPLIT = "split"
TO_PARTIAL = "to_partial"
COMM_KINDS = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL)

# A collective's fixed cost in bytes-equivalent: about 50 us of start-up latency at
# ~1 GB/s (gloo on CPU), or 5-10 us at 10-100 GB/s (NCCL). Plans that differ by
# less than this per collective are decided by their number of collectives.
COLLECTIVE_LATENCY_BYTES = 64 * 1024


class Step:
    """One move of a plan.

    ``sizes[i]`` are per-rank extra arguments, indexed by the rank's position in
    the mesh: for gather/scatter/split the piece sizes of the group along
    ``tensor_dim``; for all_to_all ``(split_sizes, cat_sizes)``. ``bytes[i]`` is
    what rank i sends.
    """

    __slots__ = ("kind", "mesh_dim", "tensor_dim", "dst_dim", "reduce_op", "sizes", "bytes")

    def __init__(self, kind, mesh_dim, tensor_dim=None, dst_dim=None, reduce_op=None, sizes=None, nbytes=None):
        self.kind = kind
        self.mesh_dim = mesh_dim
        self.tensor_dim = tensor_dim
        self.dst_dim = dst_dim
        self.reduce_op = reduce_op
        self.sizes = sizes
        self.bytes = nbytes

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def max_bytes(self) -> int:
        return max(self.bytes) if self.bytes else 0

    def __repr__(self):
        dims = f"tensor_dim={self.tensor_dim}" if self.dst_dim is None else f"{self.tensor_dim}->{self.dst_dim}"
        op = f", op={self.reduce_op}" if self.reduce_op else ""
        return f"Step({self.kind}, mesh_dim={self.mesh_dim}, {dims}{op}, bytes={self.max_bytes()})"


class Plan:
    __slots__ = ("src", "dst", "global_shape", "steps")

    def __init__(self, src, dst, global_shape, steps):
        self.src, self.dst, self.global_shape, self.steps = src, dst, global_shape, tuple(steps)

    def bytes_for_rank(self, rank_index: int) -> int:
        return sum(s.bytes[rank_index] for s in self.steps)

    def collective_counts(self):
        out = {}
        for s in self.steps:
            if s.is_comm:
                out[s.kind] = out.get(s.kind, 0) + 1
        return out

    def __repr__(self):
        return f"Plan({self.src.placements} -> {self.dst.placements}, {list(self.steps)})"


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


class _Ctx:
    """Constants of plans over one (mesh shape, global shape, itemsize): rank coordinates, and the
    local shapes of the states the search visits, memoised (the search asks for the same ones
    many times: about 2,000 per plan on a 2x2x2 mesh)."""

    _MEMO_MAX = 200_000

    def __init__(self, mesh_shape, global_shape, itemsize):
        self.mesh_shape = mesh_shape
        self.global_shape = tuple(global_shape)
        self.itemsize = itemsize
        n = _numel(mesh_shape)
        self.coords = [coordinate_of(i, mesh_shape) for i in range(n)]
        self._local = {}
        self._moves = {}

    def local(self, dim_map, coord):
        key = (dim_map, coord)
        r = self._local.get(key)
        if r is None:
            if len(self._local) >= self._MEMO_MAX:
                self._local.clear()
            r = self._local[key] = local_shape_and_offset(self.global_shape, self.mesh_shape, dim_map, coord)[0]
        return r

    def state_moves(self, state):
        """Per mesh dim: (moves that depend on ``state`` alone, whether the dim is free); memoised."""
        r = self._moves.get(state)
        if r is None:
            if len(self._moves) >= self._MEMO_MAX // 10:
                self._moves.clear()
            r = self._moves[state] = [None if k == 1 else _dim_moves(self, state, d)
                                      for d, k in enumerate(self.mesh_shape)]
        return r

    def extent_before(self, dim_map, tensor_dim, mesh_dim, coord):
        """Extent of tensor dim ``tensor_dim`` on this rank before mesh dim ``mesh_dim`` (innermost) splits it."""
        dm = list(dim_map)
        dm[tensor_dim] = tuple(x for x in dm[tensor_dim] if x != mesh_dim)
        return self.local(tuple(dm), coord)[tensor_dim]


@lru_cache(maxsize=256)
def _ctx_for(mesh_shape, global_shape, itemsize) -> _Ctx:
    return _Ctx(mesh_shape, global_shape, itemsize)


def _moves(ctx: _Ctx, state, target):
    """Yield (step, new_state) for every legal move from ``state``.

    The moves that depend on the state alone (collectives, local splits) are
    memoised per context; the ones that depend on the target (relabelling a size-1
    mesh dim, starting a Partial) are added in their place, so the order, which
    breaks ties between equally cheap plans, is the same as computing all afresh.
    """
    dim_map, partial = state
    tgt_map, tgt_partial = target
    per_dim = ctx.state_moves(state)
    for d, k in enumerate(ctx.mesh_shape):
        if k == 1:
            # A size-1 mesh dim moves no data: relabel directly toward the target.
            new_map = [tuple(x for x in dims if x != d) for dims in dim_map]
            new_partial = list(partial)
            new_partial[d] = None
            for t, dims in enumerate(tgt_map):
                if d in dims:
                    members = list(new_map[t]) + [d]
                    members.sort(key=lambda x, tm=dims, m=list(members): tm.index(x) if x in tm else 100 + m.index(x))
                    new_map[t] = tuple(members)
            if tgt_partial[d] is not None and any(p not in (None, tgt_partial[d]) for i, p in enumerate(partial)
                                                  if i != d):
                new_partial[d] = None
            else:
                new_partial[d] = tgt_partial[d]
            new = (tuple(new_map), tuple(new_partial))
            if new != state:
                yield Step("relabel", d, nbytes=(0,) * len(ctx.coords)), new
            continue
        moves, free = per_dim[d]
        yield from moves
        # Reductions of different kinds do not commute: only start a new partial when every pending
        # one has the same op (so Partial(max) is resolved before a Partial(sum) is introduced).
        if free and tgt_partial[d] is not None and all(p in (None, tgt_partial[d]) for p in partial):
            np_ = list(partial)
            np_[d] = tgt_partial[d]
            yield Step(TO_PARTIAL, d, reduce_op=tgt_partial[d], nbytes=(0,) * len(ctx.coords)), (dim_map, tuple(np_))


def _dim_moves(ctx: _Ctx, state, mesh_dim):
    """The moves along mesh dim ``mesh_dim`` (size > 1) that depend on ``state`` alone, and whether ``mesh_dim``
    is free (neither partial nor sharding a tensor dim)."""
    dim_map, partial = state
    ndim = len(dim_map)
    k = ctx.mesh_shape[mesh_dim]
    isz = ctx.itemsize
    out = []
    op = partial[mesh_dim]
    if op is not None:
        # all_reduce
        b = tuple(2 * _numel(ctx.local(dim_map, c)) * isz * (k - 1) // k for c in ctx.coords)
        np_ = list(partial)
        np_[mesh_dim] = None
        out.append((Step(ALL_REDUCE, mesh_dim, reduce_op=op, nbytes=b), (dim_map, tuple(np_))))
        # reduce_scatter serves every reduce op (gloo and NCCL both support them)
        for t in range(ndim):
            sizes, b = [], []
            for c in ctx.coords:
                ext = ctx.local(dim_map, c)
                cs = chunk_sizes(ext[t], k)
                sizes.append(cs)
                padded = max(cs) * k * (_numel(ext) // ext[t] if ext[t] else _numel(ext[:t] + ext[t + 1:]))
                b.append(padded * isz * (k - 1) // k)
            nm = list(dim_map)
            nm[t] = nm[t] + (mesh_dim,)
            out.append((Step(REDUCE_SCATTER, mesh_dim, tensor_dim=t, reduce_op=op, sizes=tuple(sizes), nbytes=tuple(b)),
                        (tuple(nm), tuple(np_))))
        return out, False
    t = next((t for t, dims in enumerate(dim_map) if mesh_dim in dims), None)
    if t is not None:
        if dim_map[t][-1] != mesh_dim:
            return out, False
        # all_gather
        sizes, b = [], []
        for c in ctx.coords:
            ext = ctx.local(dim_map, c)
            cs = chunk_sizes(ctx.extent_before(dim_map, t, mesh_dim, c), k)
            sizes.append(cs)
            rest = _numel(ext[:t] + ext[t + 1:])
            b.append(max(cs) * rest * isz * (k - 1))
        nm = list(dim_map)
        nm[t] = nm[t][:-1]
        out.append((Step(ALL_GATHER, mesh_dim, tensor_dim=t, sizes=tuple(sizes), nbytes=tuple(b)),
                    (tuple(nm), partial)))
        # all_to_all to every other tensor dim
        for u in range(ndim):
            if u == t:
                continue
            sizes, b = [], []
            for c in ctx.coords:
                ext = ctx.local(dim_map, c)
                split_sizes = chunk_sizes(ext[u], k)
                cat_sizes = chunk_sizes(ctx.extent_before(dim_map, t, mesh_dim, c), k)
                sizes.append((split_sizes, cat_sizes))
                per_unit = _numel(ext) // ext[u] if ext[u] else 0
                b.append((_numel(ext) - split_sizes[c[mesh_dim]] * per_unit) * isz)
            nm = list(dim_map)
            nm[t] = nm[t][:-1]
            nm[u] = nm[u] + (mesh_dim,)
            out.append((Step(ALL_TO_ALL, mesh_dim, tensor_dim=t, dst_dim=u, sizes=tuple(sizes), nbytes=tuple(b)),
                        (tuple(nm), partial)))
        return out, False
    # free mesh dim: local splits (a to-partial move, which depends on the target, follows in _moves)
    zero = (0,) * len(ctx.coords)
    for u in range(ndim):
        sizes = tuple(chunk_sizes(ctx.local(dim_map, c)[u], k) for c in ctx.coords)
        nm = list(dim_map)
        nm[u] = nm[u] + (mesh_dim,)
        out.append((Step(SPLIT, mesh_dim, tensor_dim=u, sizes=sizes, nbytes=zero), (tuple(nm), partial)))
    return out, True


@lru_cache(maxsize=4096)
def _plan_cached(src_key, dst_key, mesh_shape, global_shape, itemsize):
    src_map, src_partial = src_key
    dst = dst_key
    ctx = _ctx_for(mesh_shape, global_shape, itemsize)
    start = (src_map, src_partial)
    if start == dst:
        return ()
    # Dijkstra: cost = (bytes + latency-bytes per collective, comm moves, moves)
    counter = 0
    frontier = [((0, 0, 0), counter, start, ())]
    best = {start: (0, 0, 0)}
    while frontier:
        cost, _, state, path = heapq.heappop(frontier)
        if state == dst:
            return path
        if best.get(state, cost) < cost:
            continue
        for step, new in _moves(ctx, state, dst):
            comm = 1 if step.is_comm else 0
            c = (cost[0] + step.max_bytes() + comm * COLLECTIVE_LATENCY_BYTES, cost[1] + comm, cost[2] + 1)
            if c < best.get(new, (float("inf"),)):
                best[new] = c
                counter += 1
                heapq.heappush(frontier, (c, counter, new, path + (step,)))
    raise ValueError(f"no redistribution path from {src_key} to {dst_key}")


def plan(src: LayoutMath, dst: LayoutMath, global_shape, itemsize: int = 4) -> Plan:
    """Cheapest plan turning ``src`` into ``dst`` for a tensor of ``global_shape``."""
    if src.mesh_shape != dst.mesh_shape or src.rank_list != dst.rank_list:
        raise ValueError(f"redistribute: source and target layouts are on different meshes "
                         f"({src.mesh_shape} ranks {src.rank_list} vs {dst.mesh_shape} ranks {dst.rank_list}); "
                         "plan cross-mesh moves with cross_mesh_plan.cross_mesh_plan")
    if src.ndim != dst.ndim or len(global_shape) != src.ndim:
        raise ValueError(f"redistribute: layouts describe {src.ndim}-d and {dst.ndim}-d tensors but the tensor "
                         f"shape is {tuple(global_shape)}")
    steps = _plan_cached((src.dim_map, src.partial), (dst.dim_map, dst.partial), src.mesh_shape,
                         tuple(global_shape), itemsize)
    return Plan(src, dst, tuple(global_shape), steps)


__all__ = ["plan", "Plan", "Step"]
