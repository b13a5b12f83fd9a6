"""Cross-mesh redistribution planner (pure): point-to-point moves of only the overlapping pieces.

Collectives need one mesh. When the target mesh has other ranks or another
shape (a (2, 4) mesh to a (4, 2) one, a pipeline stage's submesh to the next
stage's), the move is planned as boxes: every rank of a layout holds one
axis-aligned box of the global tensor (``torch.chunk`` rules), so each target
rank needs, from each distinct source box, its intersection with that box.

* The distinct source boxes partition the tensor; a box held by several ranks
  (replicas) is sent by one of them. A receiver that holds the box itself copies
  locally; otherwise the holder that has sent the fewest bytes so far is chosen,
  so replicas share the sending (and when a box has more holders than receivers,
  each receiver's piece is cut into parts that different replicas send). Every element a receiver does not hold crosses
  the wire exactly once: the plan's bytes are the minimum.
* All pieces from one sender to one receiver travel as one message.
* ``Partial`` sources are reduced first on the source mesh with the ordinary
  (single-mesh) planner, to the non-partial layout that makes the whole move
  cheapest (``pre``); ``Partial`` targets are received as the replicated data and
  made partial locally (``post``, no communication).
* The backward pass is the reverse plan: gradients go from the target layout
  back to the reduced source layout, planned by the same rules.

Plans are per-process constants: each rank derives its own :class:`RankProgram`
(what to slice, send, receive and place) from the same plan.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, List, Tuple

from hyper_parallel.dtensor import redistribute_plan as rp
from hyper_parallel.dtensor.layout_math import LayoutMath, coordinate_of, local_shape_and_offset


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _boxes(layout: LayoutMath, global_shape) -> List[Tuple[int, Tuple[int, ...], Tuple[int, ...]]]:
    """(rank, offset, shape) of every rank of ``layout``'s mesh, in mesh order."""
    out = []
    for i, r in enumerate(layout.rank_list):
        shape, off = local_shape_and_offset(global_shape, layout.mesh_shape, layout.dim_map,
                                            coordinate_of(i, layout.mesh_shape))
        out.append((r, tuple(off), tuple(shape)))
    return out


def _intersect(off_a, shape_a, off_b, shape_b):
    start, shape = [], []
    for oa, sa, ob, sb in zip(off_a, shape_a, off_b, shape_b):
        lo, hi = max(oa, ob), min(oa + sa, ob + sb)
        if hi <= lo:
            return None
        start.append(lo)
        shape.append(hi - lo)
    return tuple(start), tuple(shape)


def _split(start, shape, parts):
    """Cut the box into up to ``parts`` pieces along its longest dim, sizes differing by at most one."""
    if parts <= 1 or not shape:
        return [(start, shape)]
    t = max(range(len(shape)), key=lambda i: shape[i])
    parts = min(parts, shape[t])
    out, off = [], 0
    for i in range(parts):
        n = shape[t] // parts + (1 if i < shape[t] % parts else 0)
        out.append((start[:t] + (start[t] + off,) + start[t + 1:], shape[:t] + (n,) + shape[t + 1:]))
        off += n
    return out


class Transfer:
    """One piece: the global box ``start``/``shape`` goes from rank ``src`` to rank ``dst``.

    ``src == dst`` is a local copy (``nbytes`` 0: nothing crosses the wire).
    """

    __slots__ = ("src", "dst", "start", "shape", "nbytes")

    def __init__(self, src, dst, start, shape, nbytes):
        self.src, self.dst, self.start, self.shape, self.nbytes = src, dst, start, shape, nbytes

    @property
    def is_local(self) -> bool:
        return self.src == self.dst

    def __repr__(self):
        kind = "copy" if self.is_local else "send"
        return f"Transfer({kind} {self.src}->{self.dst}, start={self.start}, shape={self.shape}, bytes={self.nbytes})"


class RankProgram:
    """What one rank does in a point-to-point move (all boxes in local coordinates).

    ``in_shape``/``out_shape``: its source / target local shape, ``None`` when it
    is not on that mesh. ``sends``/``recvs``: ``(peer, pieces)`` per message, a
    piece being ``(start, shape)`` inside the local input / output; the pieces of
    one message are packed flat in this order. ``copies``: ``(in_start,
    out_start, shape)`` local copies.
    """

    __slots__ = ("rank", "in_shape", "out_shape", "sends", "recvs", "copies")

    def __init__(self, rank, in_shape, out_shape, sends, recvs, copies):
        self.rank, self.in_shape, self.out_shape = rank, in_shape, out_shape
        self.sends, self.recvs, self.copies = sends, recvs, copies

    @property
    def idle(self) -> bool:
        return self.in_shape is None and self.out_shape is None

    def __repr__(self):
        return (f"RankProgram(rank={self.rank}, sends={[(p, len(x)) for p, x in self.sends]}, "
                f"recvs={[(p, len(x)) for p, x in self.recvs]}, copies={len(self.copies)})")


class P2PPlan:
    """Point-to-point moves from non-partial ``src`` to non-partial ``dst`` (possibly other meshes)."""

    __slots__ = ("src", "dst", "global_shape", "itemsize", "transfers", "_programs")

    def __init__(self, src, dst, global_shape, itemsize, transfers):
        self.src, self.dst, self.global_shape, self.itemsize = src, dst, tuple(global_shape), itemsize
        self.transfers = tuple(transfers)
        self._programs = {}

    # ---------------------------------------------------------------- costs
    def messages(self) -> Dict[Tuple[int, int], int]:
        """Bytes per (sender, receiver) message (local copies excluded)."""
        out = {}
        for t in self.transfers:
            if not t.is_local:
                out[(t.src, t.dst)] = out.get((t.src, t.dst), 0) + t.nbytes
        return out

    def bytes_sent(self, rank: int) -> int:
        return sum(t.nbytes for t in self.transfers if t.src == rank and not t.is_local)

    def sends(self, rank: int) -> int:
        """Number of messages ``rank`` sends."""
        return sum(1 for (s, _d) in self.messages() if s == rank)

    def recvs(self, rank: int) -> int:
        return sum(1 for (_s, d) in self.messages() if d == rank)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers if not t.is_local)

    def max_bytes(self) -> int:
        """Largest number of bytes any one rank sends."""
        per = {}
        for t in self.transfers:
            if not t.is_local:
                per[t.src] = per.get(t.src, 0) + t.nbytes
        return max(per.values()) if per else 0

    # ---------------------------------------------------------------- per rank
    def program(self, rank: int) -> RankProgram:
        """The :class:`RankProgram` of ``rank`` (cached)."""
        prog = self._programs.get(rank)
        if prog is None:
            prog = self._programs[rank] = self._make_program(rank)
        return prog

    def _make_program(self, rank):
        in_off = in_shape = out_off = out_shape = None
        if rank in self.src.rank_list:
            in_shape, in_off = self.src.local_shape_and_offset(self.global_shape, rank)
        if rank in self.dst.rank_list:
            out_shape, out_off = self.dst.local_shape_and_offset(self.global_shape, rank)
        sends, recvs, copies = {}, {}, []
        for t in self.transfers:
            if t.src == rank:
                in_start = tuple(s - o for s, o in zip(t.start, in_off))
                if t.is_local:
                    copies.append((in_start, tuple(s - o for s, o in zip(t.start, out_off)), t.shape))
                    continue
                sends.setdefault(t.dst, []).append((in_start, t.shape))
            elif t.dst == rank:
                recvs.setdefault(t.src, []).append((tuple(s - o for s, o in zip(t.start, out_off)), t.shape))
        return RankProgram(rank, in_shape, out_shape,
                           tuple((p, tuple(v)) for p, v in sends.items()),
                           tuple((p, tuple(v)) for p, v in recvs.items()), tuple(copies))

    def __repr__(self):
        return (f"P2PPlan({self.src.placements} on {self.src.rank_list} -> {self.dst.placements} on "
                f"{self.dst.rank_list}, {len(self.messages())} messages, {self.total_bytes} bytes)")


def _check_pair(src: LayoutMath, dst: LayoutMath, global_shape):
    if src.dim_map is None or dst.dim_map is None:
        raise ValueError("cross-mesh plan: both layouts must describe a tensor (call the mesh layout with aliases "
                         "or placements first)")
    if src.ndim != dst.ndim or len(global_shape) != src.ndim:
        raise ValueError(f"cross-mesh redistribute: the source layout describes a {src.ndim}-d tensor and the "
                         f"target layout a {dst.ndim}-d one, but the tensor's global shape is "
                         f"{tuple(global_shape)}; the global shape must have the layouts' number of dims")
    if any(int(s) < 0 for s in global_shape):
        raise ValueError(f"cross-mesh redistribute: global shape {tuple(global_shape)} has a negative extent")


@lru_cache(maxsize=4096)
def p2p_plan(src: LayoutMath, dst: LayoutMath, global_shape, itemsize: int = 4) -> P2PPlan:
    """Minimal-byte point-to-point plan from ``src`` to ``dst`` (both without ``Partial``).

    For every target rank and every distinct source box it overlaps: a local copy
    when the target rank holds that box itself, else transfers from the
    least-loaded holders (ties: first in mesh order); when a box has more holders
    than remote receivers, each receiver's piece is cut into
    ``holders // receivers`` parts sent by different replicas.
    """
    global_shape = tuple(int(s) for s in global_shape)
    _check_pair(src, dst, global_shape)
    if src.has_partial() or dst.has_partial():
        raise ValueError(f"p2p_plan: layouts must not be Partial (got {src.placements} -> {dst.placements}); "
                         "use cross_mesh_plan, which reduces partial sources first")
    holders: Dict[Tuple, List[int]] = {}
    for r, off, shape in _boxes(src, global_shape):
        if _numel(shape):
            holders.setdefault((off, shape), []).append(r)
    load = {r: 0 for r in src.rank_list}
    needs, remote = [], {}
    for r, off, shape in _boxes(dst, global_shape):
        if not _numel(shape):
            continue
        for key, hs in holders.items():
            inter = _intersect(off, shape, *key)
            if inter is not None:
                needs.append((r, key, inter))
                if r not in hs:
                    remote[key] = remote.get(key, 0) + 1
    transfers = []
    for r, key, (start, shape) in needs:
        hs = holders[key]
        if r in hs:
            transfers.append(Transfer(r, r, start, shape, 0))
            continue
        # more holders than receivers of this box: each receiver takes its piece in parts from
        # several replicas (same total bytes, a smaller share per sender)
        for p_start, p_shape in _split(start, shape, max(1, len(hs) // remote[key])):
            nbytes = _numel(p_shape) * itemsize
            sender = min(hs, key=lambda h: load[h])  # min() keeps the first of equals: mesh order
            load[sender] += nbytes
            transfers.append(Transfer(sender, r, p_start, p_shape, nbytes))
    return P2PPlan(src, dst, global_shape, itemsize, transfers)


def min_bytes(src: LayoutMath, dst: LayoutMath, global_shape, itemsize: int = 4) -> int:
    """Lower bound on bytes for ``src`` -> ``dst`` (non-partial): every element a target rank
    needs and does not hold itself must reach it once."""
    global_shape = tuple(global_shape)
    mine = {r: (off, shape) for r, off, shape in _boxes(src, global_shape)}
    total = 0
    for r, off, shape in _boxes(dst, global_shape):
        need = _numel(shape)
        if r in mine and need:
            inter = _intersect(off, shape, *mine[r])
            if inter is not None:
                need -= _numel(inter[1])
        total += need * itemsize
    return total


class CrossMeshPlan:
    """The whole move: reduce on the source mesh (``pre``), p2p moves (``moves``), make partial (``post``).

    ``pre_layout`` is the non-partial source layout the moves start from
    (``src`` itself when it has no ``Partial``); ``pre_steps`` is the single-mesh
    plan that reduces to it (``None`` when nothing to reduce). ``post_steps`` is
    the single-mesh plan (local, no communication) that turns the received
    replicated data into ``dst``'s ``Partial`` placements (``None`` when none).
    ``backward`` is the reverse p2p plan the gradient takes.
    """

    __slots__ = ("src", "dst", "global_shape", "itemsize", "pre_layout", "pre_steps", "moves", "post_steps",
                 "backward")

    def __init__(self, src, dst, global_shape, itemsize, pre_layout, pre_steps, moves, post_steps, backward):
        self.src, self.dst, self.global_shape, self.itemsize = src, dst, global_shape, itemsize
        self.pre_layout, self.pre_steps, self.moves = pre_layout, pre_steps, moves
        self.post_steps, self.backward = post_steps, backward

    @property
    def reduces_first(self) -> bool:
        return self.pre_steps is not None

    def cost(self) -> int:
        """Largest per-rank bytes of the reduction plus largest per-rank bytes of the moves."""
        pre = max((self.pre_steps.bytes_for_rank(i) for i in range(len(self.src.rank_list))), default=0) \
            if self.pre_steps is not None else 0
        return pre + self.moves.max_bytes()

    def describe(self) -> str:
        """One line per phase, e.g. for logs and error messages."""
        lines = []
        if self.pre_steps is not None:
            lines.append(f"reduce on the source mesh {self.src.placements} -> {self.pre_layout.placements}: "
                         f"{[s.kind for s in self.pre_steps.steps]}")
        lines.append(f"p2p: {len(self.moves.messages())} messages, {self.moves.total_bytes} bytes "
                     f"({self.pre_layout.placements} on ranks {self.src.rank_list} -> "
                     f"{self.moves.dst.placements} on ranks {self.dst.rank_list})")
        if self.post_steps is not None:
            lines.append(f"make partial on the target mesh (local): {self.dst.placements}")
        return "\n".join(lines)

    def __repr__(self):
        return f"CrossMeshPlan({self.describe()})"


def _pre_candidates(src: LayoutMath):
    """Non-partial layouts a partial ``src`` can be reduced to: all-reduced (Replicate), or
    reduce-scattered onto one tensor dim (every partial mesh dim appended to that dim)."""
    base = src.without_partial()
    yield base
    pdims = tuple(d for d, op in enumerate(src.partial) if op is not None)
    for t in range(src.ndim):
        dm = list(src.dim_map)
        dm[t] = dm[t] + pdims
        yield src.with_dim_map(tuple(dm))


@lru_cache(maxsize=4096)
def cross_mesh_plan(src: LayoutMath, dst: LayoutMath, global_shape, itemsize: int = 4) -> CrossMeshPlan:
    """Plan ``src`` (one mesh) -> ``dst`` (another mesh or shape) for a tensor of ``global_shape``."""
    global_shape = tuple(int(s) for s in global_shape)
    _check_pair(src, dst, global_shape)
    dst_np = dst.without_partial()
    post = rp.plan(dst_np, dst, global_shape, itemsize) if dst.has_partial() else None
    best = None
    if src.has_partial():
        for cand in _pre_candidates(src):
            pre = rp.plan(src, cand, global_shape, itemsize)
            moves = p2p_plan(cand, dst_np, global_shape, itemsize)
            p = CrossMeshPlan(src, dst, global_shape, itemsize, cand, pre, moves, post, None)
            if best is None or p.cost() < best.cost():
                best = p
    else:
        best = CrossMeshPlan(src, dst, global_shape, itemsize, src, None,
                             p2p_plan(src, dst_np, global_shape, itemsize), post, None)
    best.backward = p2p_plan(dst_np, best.pre_layout, global_shape, itemsize)
    return best


__all__ = ["cross_mesh_plan", "p2p_plan", "min_bytes", "CrossMeshPlan", "P2PPlan", "RankProgram", "Transfer"]
