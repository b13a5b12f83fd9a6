"""PyTorch's ``torch.distributed.tensor.experimental`` context-parallel API, on any backend and dtype.

``context_parallel`` (torch 2.13's signature and contract), ``context_parallel_unshard`` and
``set_rotate_method``; re-exported by ``hyper_parallel.experimental``. Differences from torch:
the attention is exact on CPU and for every dtype (float64 included); load balancing never gives
up silently (uneven head-tail shards when the length is not divisible by ``2 * cp``) and also
works without ``is_causal``; a 2-D mesh runs the hybrid (Ulysses x ring) method.

It is also the mirror of torch's private ``experimental._attention`` module (``hyper_parallel.swap``):
``_context_parallel_shard``, ``_enable_context_parallel_dispatcher`` / ``_disable_...`` (:mod:`.torch_private`)
and the load balancers (:mod:`.load_balancer`).
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Set

from hyper_parallel.context_parallel import api as _api
from hyper_parallel.context_parallel.sdpa_interception import SDPAMode, sdpa_handler
from hyper_parallel.context_parallel.shard import cp_shard, cp_unshard
from hyper_parallel.dtensor.device_mesh import resolve_mesh
from hyper_parallel.context_parallel import torch_mechanics as _tm
from hyper_parallel.context_parallel.load_balancer import (_HeadTailLoadBalancer, _LoadBalancer,  # noqa: F401
                                                           _PerDocumentHeadTailLoadBalancer, _PTRRLoadBalancer)
from hyper_parallel.context_parallel.torch_private import (_context_parallel_shard,  # noqa: F401
                                                           _disable_context_parallel_dispatcher,
                                                           _enable_context_parallel_dispatcher)


@contextlib.contextmanager
def context_parallel(mesh, *, buffers: Optional[List] = None, buffer_seq_dims: Optional[List[int]] = None,
                     no_restore_buffers: Optional[Set] = None):
    """Shard ``buffers`` in place along ``buffer_seq_dims`` and make ``F.scaled_dot_product_attention``
    context-parallel inside the block; the buffers are restored on exit (except ``no_restore_buffers``).

    Inside, SDPA on this rank's plain q/k/v (sequence at dim 2) computes exact attention over the
    whole sequence (ring on a 1-D mesh; ``set_rotate_method`` picks the K/V rotation). ``is_causal``
    and ``enable_gqa=True`` are honoured; load balancing (head-tail) follows
    ``options.enable_load_balance`` (default True, as torch).
    """
    what = "context_parallel"
    mesh = resolve_mesh(mesh, what)
    buffers = [] if buffers is None else buffers
    buffer_seq_dims = [] if buffer_seq_dims is None else buffer_seq_dims
    no_restore_buffers = set() if no_restore_buffers is None else no_restore_buffers
    if len(buffers) != len(buffer_seq_dims):
        raise ValueError("`seq_dims` must have the same number of elements as `buffers`.")
    for b in no_restore_buffers:
        if not any(b is x for x in buffers):
            raise ValueError("`no_restore_buffers` must be a subset of `buffers`.")
    method = "hybrid" if mesh.ndim == 2 else "ring"
    _api._ulysses_ring_groups(mesh, method, what)
    impl = _tm
    lb = _api.options.enable_load_balance
    originals = [None if any(b is x for x in no_restore_buffers) else impl.clone(b) for b in buffers]
    if buffers:
        shards = cp_shard(mesh, list(buffers), list(buffer_seq_dims), load_balance=lb)
        for b, s in zip(buffers, shards):
            impl.resize_copy_(b, s)
    mode = SDPAMode(sdpa_handler(mesh, method, lb, None, what))
    mode.__enter__()
    try:
        yield
    finally:
        mode.__exit__(None, None, None)
        for b, o in zip(buffers, originals):
            if o is not None:
                impl.resize_copy_(b, o)


def context_parallel_unshard(mesh, buffers: List, seq_dims: List[int], load_balancer=None) -> List:
    """The whole tensors (natural order) from this rank's shards made by ``context_parallel``.

    ``load_balancer``: None follows ``options.enable_load_balance`` (as torch); a bool says whether
    the shards are head-tail.
    """
    lb = _api.options.enable_load_balance if load_balancer is None else load_balancer
    if not isinstance(lb, bool):
        raise TypeError(f"context_parallel_unshard: load_balancer must be None or a bool, got {load_balancer!r}")
    return cp_unshard(mesh, list(buffers), list(seq_dims), load_balance=lb)


def set_rotate_method(rotate_method: str) -> None:
    """``"allgather"`` (default, as torch): one all_gather of K/V; ``"alltoall"``: K/V passed around the ring
    (point-to-point, overlapped with compute)."""
    if rotate_method == "allgather":
        _api.options.rotate_method = "allgather"
    elif rotate_method == "alltoall":
        _api.options.rotate_method = "p2p"
    else:
        raise NotImplementedError(f"Context Parallel does not support using {rotate_method} for kv shards rotation "
                                  "(expected 'allgather' or 'alltoall')")


__all__ = ["context_parallel", "context_parallel_unshard", "set_rotate_method"]
