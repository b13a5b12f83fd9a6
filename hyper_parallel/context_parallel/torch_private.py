"""torch 2.13's private context-parallel entry points that trainers call (torchtitan 0.3.0), on hyper_parallel.

* ``_context_parallel_shard(mesh, buffers, seq_dims, load_balancer=None)``: torch's signature and
  output (buffers reordered by the balancer's indices, then ``torch.chunk`` over the 1-D cp mesh),
  and it **records the order** (:class:`~.order.SequenceOrder` of the indices) for the cp group.
* ``_enable_context_parallel_dispatcher()`` / ``_disable_...``: while enabled,
  ``F.scaled_dot_product_attention`` on DTensors whose sequence dim is ``Shard`` on a cp group runs
  context-parallel ring attention in the recorded order (torch: its DTensor custom-op handler, which
  assumes head-tail whenever a balancer was given). No recorded order for the group, or one that
  does not fit the inputs' local lengths, raises; the attention is exact for any order. The rule
  lives with the other SDPA interception routes (:mod:`.sdpa_interception`); this module re-exports
  the two functions under torch's module path.

Differences from torch: any ``_LoadBalancer`` (head-tail, per-document, PTRR, a user's) gives exact
attention, not only head-tail; ``BlockMask`` buffers (FlexAttention CP) are not supported and raise;
the ring runs on every device and dtype (torch has no CPU strategy for its flash SDPA op).
"""
from __future__ import annotations

from torch.utils._pytree import tree_flatten, tree_unflatten

from hyper_parallel.context_parallel import api as _api
from hyper_parallel.context_parallel import torch_mechanics as _tm
from hyper_parallel.context_parallel.order import SequenceOrder, group_key, record, recorded
from hyper_parallel.context_parallel.sdpa_interception import (_disable_context_parallel_dispatcher,  # noqa: F401
                                                               _enable_context_parallel_dispatcher)
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
        raise ValueError(f"{what}: the cp mesh must be 1-D (slice the cp mesh dim, e.g. mesh['cp']), got {mesh}")
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


def recorded_order(mesh):
    """The sequence order the last shard helper recorded for the cp ``mesh`` (None if none)."""
    return recorded(group_key(resolve_mesh(mesh, "recorded_order")))


__all__ = ["_context_parallel_shard", "_enable_context_parallel_dispatcher", "_disable_context_parallel_dispatcher",
           "recorded_order"]
