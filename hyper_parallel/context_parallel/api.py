"""Context-parallel attention on local shards or DTensors (torch mechanics in torch_mechanics.py).

Local tensors have the ``F.scaled_dot_product_attention`` layout ``[..., heads, seq, head_dim]``;
every rank holds the rows of its sequence shard, in the order of the layout (``plan.py``).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

from hyper_parallel.context_parallel.masks import (CausalMask, NoMask, as_mask,
                                                   check_mask_len, ring_schedule)
from hyper_parallel.context_parallel.order import SequenceOrder, group_key, recorded
from hyper_parallel.context_parallel.plan import (concat_layout, nested_chunk_layout, head_split, kv_head_plan,
                                                  seg_len, shard_layout)
from hyper_parallel.dtensor.device_mesh import resolve_mesh
from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.dtensor.placement_types import Shard
from hyper_parallel.context_parallel import torch_mechanics as _tm

METHODS = ("ring", "ulysses", "hybrid")
ROTATES = ("p2p", "allgather")



class _Options:
    """Defaults read when a call does not say: the K/V rotation and torch's ``enable_load_balance``."""

    def __init__(self):
        self.rotate_method = "allgather"   # torch's default (``set_rotate_method``)
        self.enable_load_balance = True


options = _Options()


class RingPlan:
    """Plain data handed to the ring attention (ring.py)."""

    __slots__ = ("group", "schedule", "kv_lens", "mask_spec", "scale", "rotate")

    def __init__(self, group, schedule, kv_lens, mask_spec, scale, rotate):
        self.group, self.schedule, self.kv_lens = group, schedule, kv_lens
        self.mask_spec, self.scale, self.rotate = mask_spec, scale, rotate


# ----------------------------------------------------------------------------- argument checks
def _check_method(method, what):
    if method not in METHODS:
        raise ValueError(f"{what}: method must be one of {METHODS}, got {method!r}")


def _check_rotate(rotate, what):
    if rotate is None:
        rotate = options.rotate_method
    if rotate == "alltoall":       # torch's name for passing K/V to the next rank
        rotate = "p2p"
    if rotate not in ROTATES:
        raise ValueError(f"{what}: rotate must be one of {ROTATES} (or torch's 'alltoall' = 'p2p'), got {rotate!r}")
    return rotate


def _ulysses_ring_groups(mesh, method, what):
    """(U, R, ulysses group, ring group, flat index of this rank) for ``method`` on ``mesh``."""
    if method == "hybrid":
        if mesh.ndim != 2:
            raise ValueError(f"{what}: method='hybrid' needs a 2-D cp mesh (mesh dim 0 Ulysses, mesh dim 1 ring), "
                             f"got a {mesh.ndim}-D mesh {mesh}")
    elif mesh.ndim != 1:
        raise ValueError(f"{what}: method={method!r} needs a 1-D cp mesh, got a {mesh.ndim}-D mesh {mesh} (slice "
                         "the cp mesh dim, e.g. mesh['cp'], or use method='hybrid' on a 2-D mesh)")
    coord = mesh.get_coordinate()
    if coord is None:
        raise RuntimeError(f"{what}: this rank is not part of the cp mesh {mesh}")
    if method == "hybrid":
        U, R = mesh.shape
        return U, R, mesh.get_comm_group(0), mesh.get_comm_group(1), coord[0] * R + coord[1]
    n = mesh.shape[0]
    g = mesh.get_comm_group(0)
    if method == "ring":
        return 1, n, None, g, coord[0]
    return n, 1, g, None, coord[0]


def _flat_index(mesh):
    coord = mesh.get_coordinate()
    if coord is None:
        raise RuntimeError(f"this rank is not part of the cp mesh {mesh}")
    f = 0
    for c, n in zip(coord, mesh.shape):
        f = f * n + c
    return f


def _seq_layout(mesh, local_len, seq_len, load_balance, what, order=None):
    """(global length, per batch row of the order, per rank, the segments it holds) of plain-tensor inputs.

    The order is explicit: ``order=`` (a :class:`~.order.SequenceOrder`), else the one the last shard
    helper recorded for this cp group (checked against ``load_balance``), else ``seq_len`` /
    ``load_balance`` say it (hyper_parallel's layouts). Inputs that fit none raise.
    """
    cp = mesh.size()
    f = _flat_index(mesh)
    if order is not None:
        if not isinstance(order, SequenceOrder):
            raise TypeError(f"{what}: order must be a hyper_parallel.context_parallel.SequenceOrder, got "
                            f"{type(order).__name__}")
        if order.cp != cp or order.local_len(f) != local_len or (seq_len is not None and seq_len != order.seq_len):
            raise ValueError(f"{what}: this rank (cp index {f} of {cp}) holds {local_len} sequence rows, which does "
                             f"not fit the given order {order!r} (it gives this rank {order.local_len(f)} rows of "
                             f"{order.seq_len} over cp {order.cp})")
        return order.seq_len, order.layouts()
    if seq_len is None:
        rec = recorded(group_key(mesh))
        if rec is not None and rec.cp == cp and rec.local_len(f) == local_len:
            ours = SequenceOrder.from_layout(shard_layout(rec.seq_len, cp, bool(load_balance)))
            if rec != ours:
                raise ValueError(f"{what}: the inputs were sharded in the order {rec!r}, not in hyper_parallel's "
                                 f"layout with load_balance={load_balance}; use the same load_balance for cp_shard "
                                 "and the attention, or pass order=recorded_order(mesh)")
            seq_len = rec.seq_len
        else:
            seq_len = local_len * cp
    layout = shard_layout(seq_len, cp, bool(load_balance))
    if seg_len(layout[f]) != local_len:
        raise ValueError(f"{what}: this rank (cp index {f} of {cp}) holds {local_len} sequence rows, but a sequence of "
                         f"{seq_len} positions gives it {seg_len(layout[f])} (load_balance={load_balance}); "
                         "shard the inputs with cp_shard or pass seq_len=")
    return seq_len, [layout]


def _mask_for(mask, is_causal, what):
    if is_causal:
        if mask is not None and not isinstance(mask, CausalMask) and mask != "causal":
            raise ValueError(f"{what}: is_causal=True and mask={mask!r} cannot both be given")
        return CausalMask()
    return as_mask(mask, what)


# ----------------------------------------------------------------------------- attention
def context_parallel_attention(query, key, value, mesh=None, *, method: str = "ring", mask=None,
                               is_causal: bool = False, scale: Optional[float] = None, load_balance: bool = True,
                               seq_len: Optional[int] = None, rotate: Optional[str] = None,
                               dropout_p: float = 0.0, cp_mesh_dim=None, order: Optional[SequenceOrder] = None):
    """Exact attention over a sequence sharded on the cp mesh: ring, Ulysses or hybrid (Ulysses x ring).

    Args:
        query, key, value: this rank's ``[..., heads, seq_shard, head_dim]`` tensors (GQA/MQA: fewer
            K/V heads, a divisor of the query heads), laid out as :func:`cp_shard` shards them; or
            DTensors whose sequence dim (``-2``) is ``Shard`` on the cp mesh dim (two mesh dims for
            ``"hybrid"``), in natural order. K/V must have the same sequence shards as the query.
        mesh: the cp mesh (1-D for ``"ring"``/``"ulysses"``, 2-D ``(ulysses, ring)`` for ``"hybrid"``);
            taken from the DTensors when they are.
        mask / is_causal: ``"causal"``, ``"none"``/``None``, or a :class:`~.masks.Mask`
            (``SlidingWindowMask``, ``DocumentMask``); anything else raises.
        scale: the softmax scale (default ``head_dim ** -0.5``).
        load_balance: the layout of plain tensors (head-tail when True), as given to :func:`cp_shard`.
        seq_len: the global sequence length (default: from the last :func:`cp_shard` on ``mesh``, else
            local length x cp).
        rotate: ring K/V rotation, ``"p2p"`` (ring passing, overlapped) or ``"allgather"``; default
            ``options.rotate_method`` (``"allgather"``, torch's default; ``set_rotate_method`` changes it).
        dropout_p: must be 0 (attention dropout under context parallelism needs a distributed RNG
            stream for the score matrix, which is not implemented).
        cp_mesh_dim: the cp mesh dim(s) of ``mesh`` (names or indices; two for ``"hybrid"``): plain
            tensors run on that slice of ``mesh``; DTensors must have their sequence sharded on exactly
            these mesh dims. Default: the whole ``mesh`` / the mesh dims sharding the DTensors' sequence.
        order: the sequence order of plain-tensor shards (:class:`~.order.SequenceOrder`; e.g.
            ``recorded_order(mesh)`` after torch's ``_context_parallel_shard`` with any load balancer);
            default: the order the last shard helper recorded for ``mesh``, checked against
            ``load_balance``. Orders that vary along the batch run per batch row.
    """
    what = f"context_parallel_attention(method={method!r})"
    _check_method(method, what)
    rotate = _check_rotate(rotate, what)
    if dropout_p:
        raise NotImplementedError(f"{what}: dropout_p={dropout_p} > 0 is not supported: context-parallel attention "
                                  "has no distributed RNG stream for the attention probabilities (expected "
                                  "dropout_p=0.0; apply dropout outside attention)")
    mask = _mask_for(mask, is_causal, what)
    if isinstance(query, DTensor) or isinstance(key, DTensor) or isinstance(value, DTensor):
        return _dtensor_attention(query, key, value, method, mask, scale, rotate, what, cp_mesh_dim)
    mesh = resolve_mesh(mesh, what)
    if cp_mesh_dim is not None:
        cp_axes = _resolve_cp_axes(mesh, cp_mesh_dim, what)
        if len(cp_axes) != mesh.ndim or cp_axes != sorted(cp_axes):
            names = mesh.mesh_dim_names
            if not names:
                raise ValueError(f"{what}: slicing cp_mesh_dim={cp_mesh_dim!r} out of {mesh} needs mesh dim names")
            sel = tuple(names[axis] for axis in cp_axes)
            mesh = mesh[sel if len(sel) > 1 else sel[0]]
    _check_qkv(query, key, value, what)
    L = query.shape[-2]
    S, layouts = _seq_layout(mesh, L, seq_len, load_balance, what, order)
    check_mask_len(mask, S, what)
    U, R, ug, rg, f = _ulysses_ring_groups(mesh, method, what)
    return run_ordered(query, key, value, layouts, U, R, ug, rg, f, mask, scale, rotate, what)


def run_ordered(query, key, value, layouts, ulysses_size, ring_size, ulysses_group, ring_group, flat_index, mask,
                scale, rotate, what):
    """:func:`_run` with one layout for the batch, or one per batch row (dim 0) of q/k/v."""
    if len(layouts) == 1:
        return _run(query, key, value, layouts[0], ulysses_size, ring_size, ulysses_group, ring_group, flat_index,
                    mask, scale, rotate, what)
    if query.dim() < 4 or query.shape[0] != len(layouts):
        raise ValueError(f"{what}: the sequence order has {len(layouts)} batch rows but query has shape "
                         f"{tuple(query.shape)} (expected batch dim 0 of size {len(layouts)})")
    outs = [_run(query[b], key[b], value[b], layouts[b], ulysses_size, ring_size, ulysses_group, ring_group,
                 flat_index, mask, scale, rotate, what)
            for b in range(len(layouts))]
    return _tm.stack(outs, 0)


def ring_attention(query, key, value, mesh=None, **kwargs):
    """:func:`context_parallel_attention` with ``method="ring"``."""
    return context_parallel_attention(query, key, value, mesh, method="ring", **kwargs)


def ulysses_attention(query, key, value, mesh=None, **kwargs):
    """:func:`context_parallel_attention` with ``method="ulysses"``."""
    return context_parallel_attention(query, key, value, mesh, method="ulysses", **kwargs)


def hybrid_attention(query, key, value, mesh=None, **kwargs):
    """:func:`context_parallel_attention` with ``method="hybrid"`` (2-D mesh: Ulysses x ring)."""
    return context_parallel_attention(query, key, value, mesh, method="hybrid", **kwargs)


def _check_qkv(query, key, value, what):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not _tm.is_tensor(t):
            raise TypeError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() < 3:
            raise ValueError(f"{what}: {name} must be [..., heads, seq, head_dim] (>= 3 dims), got shape "
                             f"{tuple(t.shape)}")
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"{what}: query, key and value must have the same number of dims, got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape[-2] != query.shape[-2] or value.shape[-2] != query.shape[-2]:
        raise ValueError(f"{what}: mismatched sequence shards between query and key/value: local sequence lengths "
                         f"query {query.shape[-2]}, key {key.shape[-2]}, value {value.shape[-2]}; context parallelism "
                         "expects self-attention shards of one layout (equal local lengths)")
    if tuple(key.shape[:-3]) != tuple(query.shape[:-3]) or tuple(value.shape[:-1]) != tuple(key.shape[:-1]):
        raise ValueError(f"{what}: batch dims of query/key/value must agree, got shapes {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"{what}: query and key head dims differ: {query.shape[-1]} vs {key.shape[-1]}")
    hq, hk = query.shape[-3], key.shape[-3]
    if hk < 1 or hq % hk:
        raise ValueError(f"{what}: the number of query heads ({hq}) must be a multiple of the number of key/value "
                         f"heads ({hk})")


@functools.lru_cache(maxsize=256)
def _schedule(ring_layout, ring_index, mask):
    return ring_schedule([list(s) for s in ring_layout], ring_index, mask)


def _run(query, key, value, layout, ulysses_size, ring_size, ulysses_group, ring_group, flat_index, mask, scale,
         rotate, what):
    impl = _tm
    lead = tuple(query.shape[:-3])
    hq, hk = query.shape[-3], key.shape[-3]
    q4 = query.reshape((-1,) + tuple(query.shape[-3:]))
    k4 = key.reshape((-1,) + tuple(key.shape[-3:]))
    v4 = value.reshape((-1,) + tuple(value.shape[-3:]))
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    r_me, u_me = flat_index % ring_size, flat_index // ring_size
    if ulysses_size > 1:
        q_sizes = head_split(hq, ulysses_size, what)
        rep, kv_sizes = kv_head_plan(hq, hk, ulysses_size, what)
        seq_sizes = [seg_len(layout[ui * ring_size + r_me]) for ui in range(ulysses_size)]
        k4, v4 = impl.repeat_heads(k4, rep), impl.repeat_heads(v4, rep)
        q4 = impl.all_to_all(q4, ulysses_group, 1, 2, q_sizes, seq_sizes)
        k4 = impl.all_to_all(k4, ulysses_group, 1, 2, kv_sizes, seq_sizes)
        v4 = impl.all_to_all(v4, ulysses_group, 1, 2, kv_sizes, seq_sizes)
        ring_layout = tuple(tuple(concat_layout(layout, [ui * ring_size + rr for ui in range(ulysses_size)]))
                            for rr in range(ring_size))
    else:
        ring_layout = tuple(tuple(layout[rr]) for rr in range(ring_size))
    sched = _schedule(ring_layout, r_me, mask)
    plan = RingPlan(ring_group if ring_size > 1 else None, sched, [seg_len(s) for s in ring_layout], mask.spec(),
                    float(scale), rotate)
    out = impl.ring_attention(q4, k4, v4, plan)
    if ulysses_size > 1:
        out = impl.all_to_all(out, ulysses_group, 2, 1, seq_sizes, q_sizes)
    return out.reshape(lead + tuple(out.shape[-3:]))


def _resolve_cp_axes(mesh, cp_mesh_dim, what):
    dims = list(cp_mesh_dim) if isinstance(cp_mesh_dim, (tuple, list)) else [cp_mesh_dim]
    names = tuple(mesh.mesh_dim_names or ())
    out = []
    for d in dims:
        if isinstance(d, str) and d in names:
            out.append(names.index(d))
        elif isinstance(d, int) and not isinstance(d, bool) and -mesh.ndim <= d < mesh.ndim:
            out.append(d % mesh.ndim)
        else:
            raise ValueError(f"{what}: cp mesh dim {d!r} does not exist on the {mesh.ndim}-D mesh {mesh} (its dims: "
                             f"{names or tuple(range(mesh.ndim))}); expected one of those names or indices")
    return out


def _dtensor_attention(query, key, value, method, mask, scale, rotate, what, cp_mesh_dim=None):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, DTensor):
            raise TypeError(f"{what}: query, key and value must all be DTensors or all plain tensors; {name} is a "
                            f"{type(t).__name__}")
    mesh, pl, nd = query.device_mesh, tuple(query.placements), query.ndim
    for name, t in (("key", key), ("value", value)):
        if t.device_mesh != mesh or tuple(t.placements) != pl:
            raise ValueError(f"{what}: mismatched sequence shards between query and {name}: query placements {pl}, "
                             f"{name} placements {tuple(t.placements)} (expected the same mesh and placements)")
    seq = nd - 2
    cp_axes = [axis for axis, p in enumerate(pl) if isinstance(p, Shard) and p.dim % nd == seq]
    names = mesh.mesh_dim_names
    need = 2 if method == "hybrid" else 1
    if cp_mesh_dim is not None:
        want = _resolve_cp_axes(mesh, cp_mesh_dim, what)
        if want != cp_axes:
            raise ValueError(f"{what}: the sequence dim {seq} of query (global shape {tuple(query.shape)}) is not "
                             f"sharded on the cp mesh dim(s) {cp_mesh_dim!r} (mesh dims {want}); its placements are "
                             f"{pl} (expected Shard({seq}) on exactly those mesh dims)")
    if len(cp_axes) != need:
        raise ValueError(f"{what}: the sequence dim {seq} of query (global shape {tuple(query.shape)}) must be sharded "
                         f"on {need} cp mesh dim(s) (Shard({seq})), got placements {pl} on mesh dims "
                         f"{names or tuple(range(mesh.ndim))}")
    _check_qkv(query.to_local(), key.to_local(), value.to_local(), what)
    coord = mesh.get_coordinate()
    sizes = [mesh.shape[axis] for axis in cp_axes]
    f = 0
    for axis in cp_axes:
        f = f * mesh.shape[axis] + coord[axis]
    S = query.shape[seq]
    cp = 1
    for s in sizes:
        cp *= s
    layout = nested_chunk_layout(S, sizes)
    check_mask_len(mask, S, what)
    if method == "hybrid":
        U, R = sizes
        ug, rg = mesh.get_comm_group(cp_axes[0]), mesh.get_comm_group(cp_axes[1])
    elif method == "ring":
        U, R, ug, rg = 1, cp, None, mesh.get_comm_group(cp_axes[0])
    else:
        U, R, ug, rg = cp, 1, mesh.get_comm_group(cp_axes[0]), None
    out = _run(query.to_local(), key.to_local(), value.to_local(), layout, U, R, ug, rg, f, mask, scale, rotate, what)
    shape = tuple(query.shape[:-1]) + (value.shape[-1],)
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return DTensor.from_local(out, mesh, pl, shape=shape, stride=tuple(reversed(stride)))


__all__ = ["context_parallel_attention", "ring_attention", "ulysses_attention", "hybrid_attention", "options",
           "RingPlan", "METHODS", "ROTATES"]
