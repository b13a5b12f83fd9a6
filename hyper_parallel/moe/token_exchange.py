"""Token dispatch and combine for expert parallelism (torch mechanics): the token exchange.

The module is named for what it holds, the exchange of tokens with the ranks of their experts; in
this project a *module* called "dispatch" is op dispatch (``hyper_parallel.dispatch``). The public
functions keep the mixture-of-experts terms ``moe.dispatch`` / ``moe.combine`` (torchtitan's
``_token_dispatch`` / ``_token_combine``), always reached through ``hyper_parallel.moe``.

Two entry points share one exchange:

* :func:`dispatch_sorted` / :meth:`Exchange.combine` - the ``ExpertParallel`` style's path: the
  rows arrive already grouped by global expert id (torchtitan's contract) with
  ``num_tokens_per_expert``;
* :func:`dispatch` / :func:`combine` - from router outputs (top-k expert ids and weights per
  token): permute tokens by expert, optionally drop over capacity, exchange, and on the way back
  un-permute and sum the top-k outputs weighted by the routing weights.

The exchange: (1) the count exchange, one small collective (an ``all_to_all`` of the per-expert
counts, or in capacity mode an ``all_gather`` of every rank's counts) that also carries every
rank's input checks; (2) one host read of the counts (the only host synchronisation); (3) the
token ``all_to_all`` with variable splits; (4) a gather that regroups the received rows from
source-rank-major to local-expert-major order. Backward is the inverse all_to_all (and the
inverse gather). Combine is the same in reverse.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from hyper_parallel.moe import plan as _plan
from hyper_parallel.moe import comm


def count_ids(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``bincount`` without its host sync (CUDA's bincount reads the max id on the host)."""
    out = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    return out.scatter_add_(0, flat_ids.to(torch.int64), torch.ones_like(flat_ids, dtype=torch.int64))


class LocalGroup:
    """A one-rank group: dispatch without expert parallelism (no collective at all)."""

    size, rank, ranks, handle = 1, 0, (0,), None


def resolve_group(ep_mesh, what: str):
    """The :class:`CommGroup` of a 1-D EP mesh (ours or torch's), or a :class:`LocalGroup` for ``None``."""
    if ep_mesh is None:
        return LocalGroup()
    if isinstance(ep_mesh, LocalGroup):
        return ep_mesh
    from hyper_parallel.dtensor.device_mesh import DeviceMesh, adopt_foreign_mesh
    mesh = ep_mesh if isinstance(ep_mesh, DeviceMesh) else adopt_foreign_mesh(ep_mesh)
    if mesh is None:
        raise TypeError(f"{what}: ep_mesh must be a 1-D DeviceMesh (e.g. mesh['ep']) or None, got {ep_mesh!r}")
    if mesh.ndim != 1:
        raise ValueError(f"{what}: ep_mesh must be 1-D, got a {mesh.ndim}-D mesh {mesh}; slice it, e.g. "
                         f"mesh['ep']")
    _plan.check_ep_dim_names(mesh.mesh_dim_names, what)
    return mesh.get_comm_group(0)


def _regroup_index(counts: List[List[int]], device, counts_dev=None) -> Optional[torch.Tensor]:
    """Positions, in the received (source-rank-major) buffer, of the rows in local-expert-major order.

    ``counts[r][e]`` rows for local expert ``e`` came from rank ``r`` (host values; ``counts_dev``: the
    same on the device, which avoids a host-to-device copy). ``None`` when the orders agree.
    """
    ep = len(counts)
    el = len(counts[0]) if ep else 0
    if ep <= 1 or el <= 1:
        return None
    if counts_dev is None:
        counts_dev = torch.tensor(counts, dtype=torch.int64, device=device)
    c = counts_dev.to(torch.int64)                                        # [ep, el], source-major
    total = int(sum(map(sum, counts)))
    start = torch.cumsum(c.flatten(), 0) - c.flatten()                  # start of block (r, e)
    ct = c.t().flatten()                                                # expert-major block sizes
    st = start.view(ep, el).t().flatten()
    dst_start = torch.cumsum(ct, 0) - ct
    pos = torch.arange(total, device=device)
    return torch.repeat_interleave(st - dst_start, ct, output_size=total) + pos


def _inverse(index: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if index is None:
        return None
    inv = torch.empty_like(index)
    inv[index] = torch.arange(index.numel(), device=index.device)
    return inv


class Exchange:
    """One dispatch's routing on the EP group: the splits and the regrouping (reused by combine)."""

    __slots__ = ("group", "in_splits", "out_splits", "index", "inverse", "recv_counts")

    def __init__(self, group, in_splits, out_splits, recv_counts, device, recv_counts_dev=None):
        self.group = group
        self.in_splits = list(in_splits)
        self.out_splits = list(out_splits)
        self.recv_counts = recv_counts           # [ep][local experts]: rows per (source rank, local expert)
        self.index = _regroup_index(recv_counts, device, recv_counts_dev)
        self.inverse = _inverse(self.index)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Send rows grouped by destination rank; return the received rows grouped by local expert."""
        recv = comm.exchange(rows, self.in_splits, self.out_splits, self.group)
        return recv if self.index is None else recv.index_select(0, self.index)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`forward`: local-expert-major rows back to their source ranks, in sent order."""
        if self.inverse is not None:
            rows = rows.index_select(0, self.inverse)
        return comm.exchange(rows, self.out_splits, self.in_splits, self.group)

    @property
    def local_counts(self) -> List[int]:
        """Rows received per local expert (summed over source ranks)."""
        return [sum(col) for col in zip(*self.recv_counts)] if self.recv_counts else []


def _check_tails(tails, what: str, num_experts: int, rows_name: str, expected_name: str, bad_name: str):
    """Raise (on every rank alike: ``tails`` came from the count exchange) for any rank's bad input."""
    for r, (rows, expected, bad) in enumerate(tails):
        if bad:
            raise ValueError(f"{what}: EP rank {r} passed {bad} {bad_name} (expected ids in [0, {num_experts}))")
        if rows != expected:
            raise ValueError(f"{what}: EP rank {r} passed {rows_name} with {rows} rows but {expected_name} "
                             f"{expected}; token counts must match the tensor size on every rank")


def dispatch_sorted(routed_input: torch.Tensor, num_tokens_per_expert: torch.Tensor, group, num_experts: int,
                    what: str = "ExpertParallel"):
    """Exchange rows already grouped by global expert id; returns (rows for local experts grouped by local
    expert, per-local-expert counts ``[E/ep]`` on the input's device, the :class:`Exchange`)."""
    ep = group.size
    el = _plan.check_num_experts(num_experts, ep, what)
    counts = num_tokens_per_expert
    if counts.dim() != 1 or counts.shape[0] != num_experts:
        raise ValueError(f"{what}: num_tokens_per_expert must be a 1-D tensor of {num_experts} counts (one per "
                         f"expert), got shape {tuple(counts.shape)}")
    if counts.is_floating_point() or counts.is_complex():
        raise TypeError(f"{what}: num_tokens_per_expert must be an integer tensor, got {counts.dtype}")
    c64 = counts.to(torch.int64)
    # (new_full: a fill kernel, not a host-to-device copy, which would synchronise on CUDA)
    tail = torch.stack([c64.new_full((), routed_input.shape[0]), c64.sum(), (c64 < 0).sum()])
    msg = torch.cat([c64.view(ep, el), tail.expand(ep, 3)], dim=1)
    recv = comm.count_all_to_all(msg, group)                               # [ep, el + 3]
    host = comm.to_host(torch.cat([c64, recv.flatten()]))
    local = host[:num_experts]
    rows = [host[num_experts + r * (el + 3): num_experts + (r + 1) * (el + 3)] for r in range(ep)]
    _check_tails([row[el:] for row in rows], what, num_experts, "routed_input",
                 "num_tokens_per_expert sums to", "negative entries in num_tokens_per_expert")
    recv_counts = [row[:el] for row in rows]
    recv_dev = recv[:, :el]
    ex = Exchange(group, _plan.rank_splits(local, ep), [sum(c) for c in recv_counts], recv_counts,
                  routed_input.device, recv_dev)
    out = ex.forward(routed_input)
    local_counts = recv_dev.sum(0).to(counts.dtype)
    return out, local_counts, ex


class DispatchHandle:
    """What :func:`combine` needs from :func:`dispatch`, and what dispatch found out.

    Attributes:
        num_tokens, top_k: the input's token count and top-k on this rank.
        dropped: assignments (token, expert) dropped over capacity in the whole EP group (0 when dropless).
        dropped_local: assignments of this rank's tokens that were dropped.
        capacity: tokens one expert accepts per step (``None``: dropless).
        local_expert_tokens: tokens each local expert received this step (a list, host values).
        tokens_per_expert: tokens routed to each global expert in the EP group before dropping (host
            values; known in capacity mode, where the count exchange gathers every rank's counts,
            ``None`` when dropless: use :func:`~.balance.tokens_per_expert`).
    """

    __slots__ = ("num_tokens", "top_k", "order", "exchange", "dropped", "dropped_local", "capacity",
                 "local_expert_tokens", "tokens_per_expert", "_kept_mask")

    def __init__(self, **fields):
        self._kept_mask = None
        for k, v in fields.items():
            setattr(self, k, v)

    @property
    def kept_mask(self) -> torch.Tensor:
        """``[num_tokens, top_k]`` bool: which assignments reached their expert (all True when dropless)."""
        if self._kept_mask is None:
            m = torch.zeros(self.num_tokens * self.top_k, dtype=torch.bool, device=self.order.device)
            m[self.order] = True
            self._kept_mask = m.view(self.num_tokens, self.top_k)
        return self._kept_mask


def dispatch(tokens: torch.Tensor, expert_ids: torch.Tensor, ep_mesh=None, *, num_experts: int,
             capacity_factor: Optional[float] = None):
    """Send each token to its top-k experts across the EP group.

    Args:
        x: ``[T, dim]`` this rank's tokens (tokens are data-parallel across the EP ranks).
        expert_ids: ``[T, top_k]`` integer expert ids from the router (global ids in ``[0, num_experts)``).
        ep_mesh: the 1-D EP mesh (``mesh["ep"]``); ``None``: no EP (one rank holds every expert).
        num_experts: the number of experts ``E`` (each EP rank holds ``E / ep`` consecutive ones).
        capacity_factor: ``None`` (default): dropless. A number ``f > 0``: each expert accepts at most
            ``ceil(f * T_group * top_k / E)`` assignments per step (``T_group``: tokens of the whole EP
            group) and keeps the first ones in global token order (EP rank order, then token order);
            the rest are dropped and contribute 0 to :func:`combine`'s output. Reported in the handle.

    Returns:
        ``(routed, num_tokens_per_local_expert, handle)``: ``routed`` is ``[R, dim]``, the rows this rank's
        experts process, grouped by local expert (expert-major, then source rank, then token order);
        ``num_tokens_per_local_expert`` is ``[E / ep]`` int64 on ``tokens``'s device; ``handle`` goes to
        :func:`combine`.

    Every rank of the EP group must call it (same ``num_experts`` and ``capacity_factor``). Bad input
    (ids out of range, ``tokens`` and ``expert_ids`` of different lengths, on any rank) raises on every rank
    after the count exchange and before any token moves.
    """
    what = "dispatch"
    group = resolve_group(ep_mesh, what)
    ep = group.size
    el = _plan.check_num_experts(num_experts, ep, what)
    cf = _plan.check_capacity_factor(capacity_factor, what)
    if expert_ids.dim() != 2:
        raise ValueError(f"{what}: expert_ids must be [num_tokens, top_k], got shape {tuple(expert_ids.shape)}")
    if expert_ids.is_floating_point() or expert_ids.is_complex() or expert_ids.dtype == torch.bool:
        raise TypeError(f"{what}: expert_ids must be an integer tensor, got {expert_ids.dtype}")
    if tokens.dim() != 2:
        raise ValueError(f"{what}: x must be [num_tokens, dim], got shape {tuple(tokens.shape)}")
    T, k = expert_ids.shape
    _plan.check_top_k(k, num_experts, what)
    flat = expert_ids.reshape(-1).to(torch.int64)
    bad = ((flat < 0) | (flat >= num_experts)).sum()
    counts = count_ids(flat.clamp(0, num_experts - 1), num_experts)
    tail = torch.stack([counts.new_full((), tokens.shape[0]), counts.new_full((), T), bad])
    names = ("x", "expert_ids has", "expert ids out of range")
    if cf is None:
        msg = torch.cat([counts.view(ep, el), tail.expand(ep, 3)], dim=1)
        recv = comm.count_all_to_all(msg, group)
        host = comm.to_host(torch.cat([counts, recv.flatten()]))
        local = host[:num_experts]
        rows = [host[num_experts + r * (el + 3): num_experts + (r + 1) * (el + 3)] for r in range(ep)]
        _check_tails([row[el:] for row in rows], what, num_experts, *names)
        recv_counts = [row[:el] for row in rows]
        recv_dev = recv[:, :el]
        kept_local, dropped, cap, per_expert = local, 0, None, None
    else:
        allc = comm.count_all_gather(torch.cat([counts, tail]), group)   # [ep, E + 3]
        host = comm.to_host(allc.flatten())
        mat = [host[r * (num_experts + 3):(r + 1) * (num_experts + 3)] for r in range(ep)]
        _check_tails([row[num_experts:] for row in mat], what, num_experts, *names)
        full = [row[:num_experts] for row in mat]
        total_tokens = sum(row[num_experts] for row in mat)
        cap = _plan.capacity(total_tokens, k, num_experts, cf)
        kept = _plan.kept_counts(full, cap)
        me = group.rank
        kept_local, local = kept[me], full[me]
        lo, hi = _plan.local_expert_range(num_experts, ep, me)
        recv_counts = [row[lo:hi] for row in kept]
        recv_dev = None    # (the kept counts exist on the host only: one host-to-device copy below)
        dropped = sum(map(sum, full)) - sum(map(sum, kept))
        per_expert = [sum(col) for col in zip(*full)]
    order = torch.argsort(flat, stable=True)       # assignments grouped by expert, token order inside
    n_kept = sum(kept_local)
    if n_kept != T * k:                             # drop over capacity: keep the first kept[e] of expert e
        c = counts
        start = torch.cumsum(c, 0) - c
        pos = torch.arange(T * k, device=flat.device) - torch.repeat_interleave(start, c, output_size=T * k)
        limit = torch.repeat_interleave(torch.tensor(kept_local, device=flat.device), c, output_size=T * k)
        keep = pos < limit
        order = order[torch.argsort((~keep).to(torch.int8), stable=True)[:n_kept]]
    ex = Exchange(group, _plan.rank_splits(kept_local, ep), [sum(c) for c in recv_counts], recv_counts,
                  tokens.device, recv_dev)
    routed = ex.forward(tokens.index_select(0, torch.div(order, k, rounding_mode="floor")))
    handle = DispatchHandle(num_tokens=T, top_k=k, order=order, exchange=ex, dropped=dropped,
                            dropped_local=sum(local) - n_kept, capacity=cap,
                            local_expert_tokens=ex.local_counts, tokens_per_expert=per_expert)
    if recv_dev is not None:
        local_counts = recv_dev.sum(0)
    else:
        local_counts = torch.tensor(ex.local_counts, dtype=torch.int64, device=tokens.device)
    return routed, local_counts, handle


def combine(expert_output: torch.Tensor, handle: DispatchHandle, weights: Optional[torch.Tensor] = None):
    """Bring expert outputs back to their tokens and sum over the top-k, weighted by ``weights``.

    Args:
        expert_output: ``[R, dim]`` in the row order :func:`dispatch` returned.
        handle: from :func:`dispatch`.
        weights: ``[T, top_k]`` routing weights (``None``: unweighted sum, for routers that scale
            the inputs before the experts). Dropped assignments contribute 0.

    Returns ``[T, dim]``: ``out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``.
    """
    T, k = handle.num_tokens, handle.top_k
    if weights is not None and tuple(weights.shape) != (T, k):
        raise ValueError(f"combine: weights must be [num_tokens, top_k] = [{T}, {k}], got {tuple(weights.shape)}")
    back = handle.exchange.combine(expert_output)                       # [n_kept, dim], sorted order
    dim = tuple(back.shape[1:])
    full = back.new_zeros((T * k,) + dim).index_copy(0, handle.order, back)
    full = full.view((T, k) + dim)
    if weights is None:
        return full.sum(1)
    w = weights.to(full.dtype).reshape((T, k) + (1,) * len(dim))
    return (full * w).sum(1)
