"""torch 2.13's private context-parallel entry points that trainers call (torchtitan 0.3.0), on hyper_parallel.

* ``_context_parallel_shard(mesh, buffers, seq_dims, load_balancer=None)``: torch's signature and
  output (buffers reordered by the balancer's indices, then ``torch.chunk`` over the 1-D cp mesh),
  and it **records the order** (:class:`~.order.SequenceOrder` of the indices) for the cp group.
* ``_enable_context_parallel_dispatcher()`` / ``_disable_...``: while enabled,
  ``F.scaled_dot_product_attention`` on DTensors whose sequence dim is ``Shard`` on a cp group runs
  context-parallel ring attention in the recorded order (torch: its DTensor custom-op handler, which
  assumes head-tail whenever a balancer was given). No recorded order for the group, or one that
  does not fit the inputs' local lengths, raises; the attention is exact for any order.

Differences from torch: any ``_LoadBalancer`` (head-tail, per-document, PTRR, a user's) gives exact
attention, not only head-tail; ``BlockMask`` buffers (FlexAttention CP) are not supported and raise;
the ring runs on every device and dtype (torch has no CPU strategy for its flash SDPA op).
"""
from __future__ import annotations

from torch.utils._pytree import tree_flatten, tree_unflatten

from hyper_parallel.context_parallel import api as _api
from hyper_parallel.context_parallel import torch_mechanics as _tm
from hyper_parallel.context_parallel.masks import CausalMask, NoMask
from hyper_parallel.context_parallel.order import SequenceOrder, group_key, record, recorded
from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, bind_args, get_rule, is_dtensor, override
from hyper_parallel.dtensor.device_mesh import resolve_mesh


def _indices(load_balancer, what):
    if load_balancer is None:
        return None
    gen = getattr(load_balancer, "_generate_indices", None)
    if gen is None:
        raise TypeError(f"{what}: load_balancer must be a _LoadBalancer (with _generate_indices), got "
                        f"{type(load_balancer).__name__}")
    idx = gen()
    if not _tm.is_tensor(idx) or idx.dim() != 2:
        raise ValueError(f"{what}: load balance index expects shape (1, seq_len) or (B, seq_len) but got "
                         f"{getattr(idx, 'shape', idx)!r}")
    return idx


def _context_parallel_shard(mesh, buffers, seq_dims, load_balancer=None):
    """This rank's shards of ``buffers`` along ``seq_dims`` (torch 2.13's semantics); records their order."""
    what = "_context_parallel_shard"
    _api.options.enable_load_balance = load_balancer is not None      # torch's global, mirrored
    if len(buffers) != len(seq_dims):
        raise ValueError("`seq_dims` must have the same number of elements as `buffers`.")
    flat, spec = tree_flatten(buffers)
    flat_dims, _ = tree_flatten(seq_dims)
    if len(flat) != len(flat_dims):
        raise ValueError("`seq_dims` must have the pytree structure as `buffers`.")
    mesh = resolve_mesh(mesh, what)
    if mesh.ndim != 1:
        raise ValueError(f"{what}: the cp mesh must be 1-D (slice the cp dim, e.g. mesh['cp']), got {mesh}")
    cp, f = mesh.size(), _api._flat_index(mesh)
    for i, b in enumerate(flat):
        if not _tm.is_tensor(b):
            raise NotImplementedError(f"{what}: buffer {i} is a {type(b).__name__}; hyper_parallel shards tensors "
                                      "only (BlockMask buffers, FlexAttention context parallelism, are not supported)")
        if b.device != flat[0].device:
            raise AssertionError("All buffers must be on the same device")
    idx = _indices(load_balancer, what)
    outs, S = [], None
    for i, (x, d) in enumerate(zip(flat, flat_dims)):
        if not isinstance(d, int) or not -x.dim() <= d < x.dim():
            raise ValueError(f"{what}: seq_dims[{i}]={d!r} is not a dim of buffer {i} (shape {tuple(x.shape)})")
        d %= x.dim()
        S = x.shape[d] if S is None else S
        if x.shape[d] != S:
            raise ValueError(f"{what}: buffer {i} has sequence length {x.shape[d]} along dim {d}, buffer 0 has {S}; "
                             "all buffers must share one sequence")
        if idx is not None:
            nb, data_b = idx.shape[0], (x.shape[0] if d > 0 else 1)
            if nb != 1 and nb != data_b:
                raise ValueError(f"Cannot rearrange buffer: load_balance_indices has shape {tuple(idx.shape)}, "
                                 f"but buffer has shape {tuple(x.shape)}.")
            if idx.shape[1] != S:
                raise ValueError(f"{what}: the load balancer's indices cover {idx.shape[1]} positions, the buffers' "
                                 f"sequence has {S}")
            x = _tm.gather_seq(x, d, idx)
        outs.append(_tm.chunk_of(x, d, cp, f))
    if S is not None:
        rows = [list(range(S))] if idx is None else idx.tolist()
        src = "no load balancer" if idx is None else type(load_balancer).__name__
        record(group_key(mesh), SequenceOrder(rows, cp, f"_context_parallel_shard({src})", what))
    return tree_unflatten(outs, spec)


_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _CPSDPARule(DistributedOp):
    """SDPA while the context-parallel dispatcher is on: sequence-sharded DTensors -> ring attention in the
    recorded order; everything else -> the rule that served SDPA before."""

    float_args_matter = True

    def __init__(self, previous):
        super().__init__("scaled_dot_product_attention", register=False)
        self.previous = previous

    def _fallback(self, call):
        if self.previous is None:
            raise NotImplementedError("scaled_dot_product_attention has no DTensor rule")
        return self.previous.strategy(call)

    def strategy(self, call):
        what = "context-parallel SDPA (_enable_context_parallel_dispatcher)"
        v = bind_args(call.args, call.kwargs, _SDPA_NAMES)
        q, k, val = v.get("query"), v.get("key"), v.get("value")
        if not is_dtensor(q) or not call.layouts:
            return self._fallback(call)
        lq, sq = call.layouts[0], tuple(call.shapes[0])
        seq = len(sq) - 2
        dims = lq.dim_map[seq] if seq >= 0 else ()
        if not dims:
            return self._fallback(call)
        if not (is_dtensor(k) and is_dtensor(val)) or len(call.layouts) != 3:
            raise NotImplementedError(f"{what}: query, key and value must be DTensors sharded alike and attn_mask "
                                      "must be None (use is_causal=True)")
        if len(dims) != 1:
            raise NotImplementedError(f"{what}: the query's sequence dim is sharded on mesh dims {dims}; context "
                                      "parallelism shards it on one cp mesh dim")
        for name, lay in (("key", call.layouts[1]), ("value", call.layouts[2])):
            if lay != lq:
                raise ValueError(f"{what}: {name} is laid out as {lay}, query as {lq}; key and value must be sharded "
                                 "like the query (the same sequence order)")
        if lq.has_partial() or lq.dim_map[-1]:
            raise NotImplementedError(f"{what}: query layout {lq} has a Partial or a sharded head dim")
        if float(v.get("dropout_p", 0.0) or 0.0):
            raise NotImplementedError(f"{what}: dropout_p={v.get('dropout_p')} > 0 is not supported (expected 0.0)")
        mesh_dim, mesh = dims[0], call.mesh
        sv = tuple(call.shapes[2])
        out_shape = sq[:-1] + (sv[-1],)
        batch_sharded = bool(lq.dim_map[0]) if len(sq) >= 4 else False

        def local_fn(*args, **kwargs):
            a = bind_args(args, kwargs, _SDPA_NAMES)
            ql, kl, vl = a["query"], a["key"], a["value"]
            group = mesh.get_comm_group(mesh_dim)
            key = tuple(group.ranks)
            order = recorded(key)
            L, f = ql.shape[-2], group.rank
            if order is None:
                raise RuntimeError(f"{what}: the query is sequence-sharded over the cp group of ranks {list(key)}, but "
                                   "no sequence order is recorded for that group, so the positions of the local rows "
                                   "are unknown; shard the inputs with _context_parallel_shard (or cp_shard) first")
            if order.cp != len(key) or order.local_len(f) != L:
                raise RuntimeError(f"{what}: this rank (cp index {f}) holds {L} sequence rows, but the recorded order "
                                   f"{order!r} gives it {order.local_len(f)}; the inputs were not sharded by the last "
                                   "_context_parallel_shard on this cp group")
            if order.batch > 1 and (batch_sharded or ql.dim() < 4 or ql.shape[0] != order.batch):
                raise RuntimeError(f"{what}: the recorded order varies along a batch of {order.batch} rows, but the "
                                   f"local query has shape {tuple(ql.shape)} (batch dim 0 must be whole, of that size)")
            hq, hk = ql.shape[-3], kl.shape[-3]
            if hq != hk and not a.get("enable_gqa", False):
                raise ValueError(f"{what}: query has {hq} heads and key/value {hk}; pass enable_gqa=True")
            mask = CausalMask() if a.get("is_causal", False) else NoMask()
            rotate = _api._check_rotate(None, what)
            return _api.run_ordered(ql, kl, vl, order.layouts(), 1, len(key), None, group, f, mask,
                                    a.get("scale"), rotate, what)
        return Strategy([lq, lq, lq], lq, local_fn=local_fn, out_shapes=out_shape)


_STATE = {"override": None}


def _enable_context_parallel_dispatcher() -> None:
    """Route sequence-sharded DTensor SDPA to context-parallel attention in the recorded order (idempotent)."""
    if _STATE["override"] is None:
        _STATE["override"] = override("scaled_dot_product_attention",
                                      _CPSDPARule(get_rule("scaled_dot_product_attention")))


def _disable_context_parallel_dispatcher() -> None:
    h = _STATE["override"]
    if h is not None:
        _STATE["override"] = None
        h.undo()


def recorded_order(mesh):
    """The sequence order the last shard helper recorded for the cp ``mesh`` (None if none)."""
    return recorded(group_key(resolve_mesh(mesh, "recorded_order")))


__all__ = ["_context_parallel_shard", "_enable_context_parallel_dispatcher", "_disable_context_parallel_dispatcher",
           "recorded_order"]
