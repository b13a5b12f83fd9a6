"""Ring attention on local tensors: a ``torch.autograd.Function`` with an exact, ring-passed backward.

Forward, at ring step ``i`` rank ``me`` holds the K/V block of ring rank ``(me - i) % R`` and runs
the calls the planner gave it for that step, merging each block's ``(out, lse)`` into running
accumulators (online softmax). K/V move by one of two rotations:

* ``"p2p"``: K and V packed in one buffer, sent to the next rank and received from the previous
  one with ``batch_isend_irecv`` posted *before* the step's compute and waited after it (overlap);
  ``R - 1`` sends per rank per forward.
* ``"allgather"``: one asynchronous all_gather of the packed K/V, overlapped with the local block.

Backward (flash-attention style, nothing of the forward is recomputed but the block scores): with
the final ``lse`` and ``delta = rowsum(dout * out)`` every block's ``dq``, ``dk``, ``dv`` follow
directly. ``"p2p"``: K/V rotate again, and each block's dK/dV accumulator travels around the ring
with it (received from the previous rank, this rank's contribution added, sent on; after ``R``
sends it is back at its owner). ``"allgather"``: K/V gathered again, dK/dV of all blocks
reduce-scattered to their owners.

Saved for backward: the local q, k, v, out and lse only (``1/cp`` of the sequence).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hyper_parallel.distributed import comm_record as rec
from hyper_parallel.distributed import collectives as C
from hyper_parallel.context_parallel import kernels as K

_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# When a dict, ring steps add their compute and communication-wait seconds to it (benchmarks).
STATS = None


def _tick():
    return time.perf_counter() if STATS is not None else 0.0


def _add(key, start):
    if STATS is not None:
        STATS[key] = STATS.get(key, 0.0) + time.perf_counter() - start


class _Exchange:
    """One posted ring exchange: send ``buf`` to the next rank, receive ``recv_numel`` elements from the previous."""

    def __init__(self, buf, recv_numel, group):
        me, R = group.rank, group.size
        nxt, prv = group.ranks[(me + 1) % R], group.ranks[(me - 1) % R]
        buf = buf.contiguous()
        self.recv = buf.new_empty(recv_numel)
        esz = buf.element_size()
        rec.record(rec.SEND, buf.numel() * esz, (group.ranks[me], nxt))
        rec.record(rec.RECV, recv_numel * esz, (prv, group.ranks[me]))
        self._keep = buf
        self.reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, nxt, group=group.handle),
                                            dist.P2POp(dist.irecv, self.recv, prv, group=group.handle)])

    def wait(self):
        t0 = _tick()
        for r in self.reqs:
            r.wait()
        _add("wait_s", t0)
        return self.recv


class _AllGather:
    """Asynchronous all_gather of flat buffers of per-rank sizes ``sizes`` (padded on the wire)."""

    def __init__(self, flat, sizes, group):
        m = max(sizes)
        self.sizes = sizes
        x = flat if flat.numel() == m else torch.cat([flat, flat.new_zeros(m - flat.numel())])
        self.out = x.new_empty(m * group.size)
        rec.record(rec.ALL_GATHER, m * x.element_size(), group.ranks)
        self.work = _AG(self.out, x.contiguous(), group=group.handle, async_op=True)

    def wait(self):
        t0 = _tick()
        self.work.wait()
        _add("wait_s", t0)
        m = max(self.sizes)
        return [self.out.narrow(0, i * m, n) for i, n in enumerate(self.sizes)]


def _pack(key, value):
    return torch.cat([key.reshape(-1), value.reshape(-1)])


def _unpack(buf, kshape, vshape, rows):
    """K, V of a block with ``rows`` rows from a packed buffer (shapes of this rank's block, rows replaced)."""
    ks = kshape[:-2] + (rows, kshape[-1])
    vs = vshape[:-2] + (rows, vshape[-1])
    nk = ks[0] * ks[1] * ks[2] * ks[3]
    return buf[:nk].view(ks), buf[nk:].view(vs)


class RingAttention(torch.autograd.Function):
    """``out = ring_attention(q [B,Hq,L,D], k [B,Hk,Lk,D], v [B,Hk,Lk,Dv], plan)``.

    ``plan`` (plain data): ``group`` (CommGroup or None for one rank), ``schedule`` (per step a list
    of calls with ``q_rows``, ``q_pos``, ``k_rows``, ``k_pos``, ``masked``), ``kv_lens`` (rows of every
    ring rank's K/V block), ``mask_spec``, ``scale``, ``rotate`` ("p2p" | "allgather").
    """

    @staticmethod
    def forward(ctx, query, key, value, plan):
        out, lse = _forward(query, key, value, plan)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan = plan
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, dout, ctx.plan)
        return dq, dk, dv, None


def _fold(tensor, kv_heads):
    B, H, L, D = tensor.shape
    return tensor.reshape(B, kv_heads, H // kv_heads, L, D)


def _run_calls(calls, query5, key_block, value_block, plan, acc_o, acc_l, written):
    for c in calls:
        t0 = _tick()
        qc = K.rows(query5, c.q_rows)
        kc, vc = K.rows(key_block, c.k_rows), K.rows(value_block, c.k_rows)
        if K.fused_ok(c, plan.mask_spec, query5, value_block):
            o, l = K.fused_forward(qc, kc, vc, c.masked, plan.scale)
        else:
            mask = K.dense_mask(plan.mask_spec, c.q_pos, c.k_pos, query5.device) if c.masked else None
            o, l = K.block_forward(qc, kc, vc, mask, plan.scale)
        K.merge_into(acc_o, acc_l, o, l, c.q_rows, written)
        _add("compute_s", t0)


def _forward(query, key, value, plan):
    dt = K.acc_dtype(query.dtype)
    hk = key.shape[1]
    q5 = _fold(query.to(dt), hk)
    key, value = key.to(dt).contiguous(), value.to(dt).contiguous()
    B, _, g, L, _ = q5.shape
    acc_o = q5.new_zeros(B, hk, g, L, value.shape[-1])
    acc_l = q5.new_full((B, hk, g, L), K.NEG_INF)
    written = []
    group, sched = plan.group, plan.schedule
    R = 1 if group is None else group.size
    me = 0 if group is None else group.rank
    if R == 1:
        _run_calls(sched[0], q5, key, value, plan, acc_o, acc_l, written)
    elif plan.rotate == "allgather":
        sizes = [n * B * hk * (key.shape[-1] + value.shape[-1]) for n in plan.kv_lens]
        ag = _AllGather(_pack(key, value), sizes, group)
        _run_calls(sched[0], q5, key, value, plan, acc_o, acc_l, written)
        blocks = ag.wait()
        for i in range(1, R):
            src = (me - i) % R
            kb, vb = _unpack(blocks[src], tuple(key.shape), tuple(value.shape), plan.kv_lens[src])
            _run_calls(sched[i], q5, kb, vb, plan, acc_o, acc_l, written)
    else:
        kb, vb, buf = key, value, None
        for i in range(R):
            src = (me - i) % R
            ex = None
            if i < R - 1:
                nsrc = (me - i - 1) % R
                n = plan.kv_lens[nsrc] * B * hk * (key.shape[-1] + value.shape[-1])
                ex = _Exchange(_pack(kb, vb) if buf is None else buf, n, group)
            _run_calls(sched[i], q5, kb, vb, plan, acc_o, acc_l, written)
            if ex is not None:
                buf = ex.wait()
                kb, vb = _unpack(buf, tuple(key.shape), tuple(value.shape), plan.kv_lens[nsrc])
    out = acc_o.reshape(B, hk * g, L, value.shape[-1])
    return out, acc_l


def _bwd_calls(calls, query5, key_block, value_block, do5, out5, lse, delta, plan, dq5, dkb, dvb):
    for c in calls:
        t0 = _tick()
        qc, doc = K.rows(query5, c.q_rows), K.rows(do5, c.q_rows)
        lc, dc = K.rows(lse, c.q_rows, -1), K.rows(delta, c.q_rows, -1)
        kc, vc = K.rows(key_block, c.k_rows), K.rows(value_block, c.k_rows)
        if K.fused_ok(c, plan.mask_spec, query5, value_block):
            dq, dk, dv = K.fused_backward(qc, kc, vc, doc, K.rows(out5, c.q_rows), lc, c.masked, plan.scale)
        else:
            mask = K.dense_mask(plan.mask_spec, c.q_pos, c.k_pos, query5.device) if c.masked else None
            dq, dk, dv = K.block_backward(qc, kc, vc, doc, lc, dc, mask, plan.scale)
        K.add_rows(dq5, dq, c.q_rows)
        K.add_rows(dkb, dk, c.k_rows)
        K.add_rows(dvb, dv, c.k_rows)
        _add("compute_s", t0)


def _backward(query, key, value, out, lse, dout, plan):
    dt = K.acc_dtype(query.dtype)
    kdt, vdt = key.dtype, value.dtype
    hk = key.shape[1]
    q5 = _fold(query.to(dt), hk)
    do5 = _fold(dout.to(dt), hk)
    key, value = key.to(dt).contiguous(), value.to(dt).contiguous()
    B, _, g, L, D = q5.shape
    o5 = _fold(out, hk)
    delta = (do5 * o5).sum(-1)
    dq5 = torch.zeros_like(q5)
    group, sched = plan.group, plan.schedule
    R = 1 if group is None else group.size
    me = 0 if group is None else group.rank
    kshape, vshape = tuple(key.shape), tuple(value.shape)
    per_row = B * hk * (key.shape[-1] + value.shape[-1])
    if R == 1:
        dk, dv = torch.zeros_like(key), torch.zeros_like(value)
        _bwd_calls(sched[0], q5, key, value, do5, o5, lse, delta, plan, dq5, dk, dv)
    elif plan.rotate == "allgather":
        sizes = [n * per_row for n in plan.kv_lens]
        ag = _AllGather(_pack(key, value), sizes, group)
        dflat = [None] * R
        dk0, dv0 = torch.zeros_like(key), torch.zeros_like(value)
        _bwd_calls(sched[0], q5, key, value, do5, o5, lse, delta, plan, dq5, dk0, dv0)
        dflat[me] = _pack(dk0, dv0)
        blocks = ag.wait()
        for i in range(1, R):
            src = (me - i) % R
            kb, vb = _unpack(blocks[src], kshape, vshape, plan.kv_lens[src])
            dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
            _bwd_calls(sched[i], q5, kb, vb, do5, o5, lse, delta, plan, dq5, dkb, dvb)
            dflat[src] = _pack(dkb, dvb)
        mine = C.reduce_scatter(torch.cat(dflat), 0, group, sizes)
        dk, dv = _unpack(mine, kshape, vshape, plan.kv_lens[me])
    else:
        kb, vb, buf = key, value, None
        dex = None
        for i in range(R):
            src = (me - i) % R
            ex = None
            if i < R - 1:
                nsrc = (me - i - 1) % R
                ex = _Exchange(_pack(kb, vb) if buf is None else buf, plan.kv_lens[nsrc] * per_row, group)
            dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
            _bwd_calls(sched[i], q5, kb, vb, do5, o5, lse, delta, plan, dq5, dkb, dvb)
            acc = _pack(dkb, dvb)
            if dex is not None:
                acc = acc + dex.wait()            # this block's dK/dV from the ranks before
            # send it on; receive the accumulator of the next step's block (after the last step: our own)
            nrecv = plan.kv_lens[(me - i - 1) % R] * per_row
            dex = _Exchange(acc, nrecv, group)
            if ex is not None:
                buf = ex.wait()
                kb, vb = _unpack(buf, kshape, vshape, plan.kv_lens[nsrc])
        dk, dv = _unpack(dex.wait(), kshape, vshape, plan.kv_lens[me])
    dq = dq5.reshape(B, hk * g, L, D)
    return dq.to(query.dtype), dk.to(kdt), dv.to(vdt)


__all__ = ["RingAttention", "STATS"]
