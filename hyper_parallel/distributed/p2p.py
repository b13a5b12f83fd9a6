"""Batched point-to-point exchange of boxes (cross-mesh redistribution's executor).

A :class:`~hyper_parallel.dtensor.cross_mesh_plan.RankProgram` says which
boxes of this rank's input go to which peer, which boxes of its output come
from which peer, and which are copied locally. :func:`exchange` packs each
message into one flat buffer, posts every send and receive at once with
``torch.distributed.batch_isend_irecv`` (no ordering deadlock, whatever the
pattern), copies locally while they fly, waits, and unpacks. Every message is
reported to :mod:`hyper_parallel.distributed.comm_record` as one ``send`` (bytes
of the buffer) or one ``recv``.

:class:`CrossMeshExchange` makes it differentiable: the backward runs the
reverse program (gradient from the target layout back to the source layout).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hyper_parallel.distributed import comm_record as rec
from hyper_parallel.distributed.collective_errors import CHECK as _CHECK
from hyper_parallel.distributed import collective_guard as _fault


def _box(tensor: torch.Tensor, start, shape) -> torch.Tensor:
    for d, (s, n) in enumerate(zip(start, shape)):
        if s != 0 or n != tensor.shape[d]:
            tensor = tensor.narrow(d, s, n)
    return tensor


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def exchange(tensor: torch.Tensor, prog) -> torch.Tensor:
    """Run ``prog`` on this rank's ``tensor``; returns the output local tensor.

    A rank with no output shape (not on the target mesh) gets an empty 1-d
    tensor; a rank with no input shape (not on the source mesh) never reads ``tensor``
    (only its dtype and device).
    """
    if prog.in_shape is not None and tuple(tensor.shape) != tuple(prog.in_shape):
        raise ValueError(f"cross-mesh redistribute: rank {prog.rank}'s local tensor has shape {tuple(tensor.shape)} "
                         f"but the source layout gives it {tuple(prog.in_shape)}; the DTensor's global shape does not "
                         "match its local data")
    out = tensor.new_empty(prog.out_shape) if prog.out_shape is not None else tensor.new_empty(0)
    if _CHECK[0]:
        _fault.check_p2p(tensor, prog)
    ops, unpack, peers = [], [], []
    esz = tensor.element_size()
    me = prog.rank
    for peer, pieces in prog.sends:
        parts = [_box(tensor, st, sh).reshape(-1) for st, sh in pieces]
        buf = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
        rec.record(rec.SEND, buf.numel() * esz, (me, peer))
        ops.append(dist.P2POp(dist.isend, buf, peer))
        peers.append(("send to", peer))
    for peer, pieces in prog.recvs:
        buf = tensor.new_empty(sum(_numel(sh) for _st, sh in pieces))
        rec.record(rec.RECV, buf.numel() * esz, (peer, me))
        ops.append(dist.P2POp(dist.irecv, buf, peer))
        peers.append(("recv from", peer))
        unpack.append((buf, pieces))
    try:
        reqs = dist.batch_isend_irecv(ops) if ops else []
    except RuntimeError as exc:  # a peer already gone can fail the posting itself
        ps = sorted({q for _, q in peers})
        _fault.fail(f"cross-mesh p2p (batch_isend_irecv with ranks {ps})", None, exc,
                    peer=ps[0] if len(ps) == 1 else None)
    for in_start, out_start, shape in prog.copies:
        _box(out, out_start, shape).copy_(_box(tensor, in_start, shape))
    for i, r in enumerate(reqs):
        try:
            r.wait()
        except RuntimeError as exc:
            # one work per message on gloo; a coalesced backend (NCCL) returns one for the batch
            ps = sorted({q for _, q in peers})
            how, peer = peers[i] if len(reqs) == len(peers) else ("exchange with", ps[0] if len(ps) == 1 else None)
            _fault.fail(f"cross-mesh p2p ({how} rank {peer})" if peer is not None else
                        f"cross-mesh p2p (batch_isend_irecv with ranks {ps})", None, exc, peer=peer)
    for buf, pieces in unpack:
        pos = 0
        for st, sh in pieces:
            n = _numel(sh)
            _box(out, st, sh).copy_(buf[pos:pos + n].view(sh))
            pos += n
    return out


class CrossMeshExchange(torch.autograd.Function):
    """``exchange(x, fwd)``; backward ``exchange(grad, bwd)`` (the reverse plan's program).

    Ranks not on the source mesh pass a placeholder ``x`` and get a zero gradient
    of its shape. Every rank that took part in the forward must run the backward
    (ranks only on the source mesh backpropagate through their empty output), or
    the ranks waiting for its gradient messages wait forever.
    """

    @staticmethod
    def forward(ctx, tensor, fwd, bwd):
        ctx.bwd = bwd
        ctx.x_shape = tuple(tensor.shape)
        return exchange(tensor, fwd)

    @staticmethod
    def backward(ctx, grad_output):
        bwd = ctx.bwd
        gx = exchange(grad_output.contiguous(), bwd)
        if bwd.out_shape is None:
            gx = grad_output.new_zeros(ctx.x_shape)
        return gx, None, None


__all__ = ["exchange", "CrossMeshExchange"]
