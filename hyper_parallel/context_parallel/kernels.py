"""Block attention kernels on local tensors: forward returns (out, lse); backward from the final lse.

Shapes: queries are folded by K/V head, ``q5 [B, Hk, g, Lq, D]`` (``g = Hq / Hk``, GQA/MQA without
repeating K/V), ``k, v [B, Hk, Lk, D]``. The math is explicit (two matmuls and a logsumexp), so it
runs on any device and dtype, float64 included; inputs of 16-bit dtypes are computed in float32.
Rows whose keys are all masked get ``lse = -inf`` and output 0 (they merge as "no contribution").
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def positions(segs, device) -> torch.Tensor:
    parts = [torch.arange(s, s + n, device=device) for s, n in segs]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def dense_mask(spec, q_pos, k_pos, device):
    """Boolean ``[Lq, Lk]`` (True = attend) of mask ``spec`` at the given global position segments."""
    kind = spec[0]
    qp = positions(q_pos, device).unsqueeze(-1)
    kp = positions(k_pos, device).unsqueeze(0)
    if kind == "causal":
        return kp <= qp
    if kind == "sliding_window":
        return (kp <= qp) & (kp > qp - spec[1])
    if kind == "document":
        cu = torch.tensor(spec[1], device=device)
        dq = torch.searchsorted(cu, qp, right=True)
        dk = torch.searchsorted(cu, kp, right=True)
        m = dq == dk
        return m & (kp <= qp) if spec[2] else m
    if kind == "none":
        return None
    raise NotImplementedError(f"context-parallel attention: unknown mask kind {kind!r}")


def rows(x: torch.Tensor, ranges, dim: int = -2) -> torch.Tensor:
    parts = [x.narrow(dim, lo, hi - lo) for lo, hi in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def block_forward(q5, k, v, mask, scale):
    s = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale           # [B, Hk, g, Lq, Lk]
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)                                          # [B, Hk, g, Lq]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    return torch.matmul(p, v.unsqueeze(2)), lse                               # [B, Hk, g, Lq, Dv]


def block_backward(q5, k, v, dout5, lse, delta, mask, scale):
    """dq5, dk, dv of one block, given the *final* lse and delta = rowsum(dout * out) of its rows."""
    s = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout5).sum(2)
    dp = torch.matmul(dout5, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2) * scale
    return dq, dk, dv


def merge_into(acc_o, acc_l, o, l, ranges, written=None) -> None:
    """Online-softmax merge of a block result (rows = concatenation of ``ranges``) into the accumulators.

    ``written``: the row ranges merged so far (a list this call extends); rows not yet written are
    copied instead of merged.
    """
    at = 0
    for lo, hi in ranges:
        n = hi - lo
        ao, al = acc_o.narrow(-2, lo, n), acc_l.narrow(-1, lo, n)
        bo, bl = o.narrow(-2, at, n), l.narrow(-1, at, n)
        if written is not None:
            fresh = all(hi <= a or lo >= b for a, b in written)
            written.append((lo, hi))
            if fresh:
                ao.copy_(bo)
                al.copy_(bl)
                at += n
                continue
        new = torch.logaddexp(al, bl)
        safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
        ao.mul_(torch.exp(al - safe).unsqueeze(-1)).add_(bo * torch.exp(bl - safe).unsqueeze(-1))
        al.copy_(new)
        at += n


def add_rows(acc, x, ranges, dim: int = -2) -> None:
    at = 0
    for lo, hi in ranges:
        n = hi - lo
        acc.narrow(dim, lo, n).add_(x.narrow(dim, at, n))
        at += n


__all__ = ["acc_dtype", "dense_mask", "rows", "block_forward", "block_backward", "merge_into", "add_rows"]


# torch's fused CPU kernel (returns the lse; its backward takes the final out and lse), used for the
# unmasked blocks and the causal diagonal blocks of equal positions on CPU; everything else (other
# masks, rows that could be fully masked, other devices) runs the explicit math above.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
USE_FUSED = True


def fused_ok(call, spec, q5, v) -> bool:
    if not USE_FUSED or _FLASH is None or q5.device.type != "cpu" or v.shape[-1] != q5.shape[-1]:
        return False
    if not call.masked:
        return True
    return spec[0] == "causal" and q5.shape[2] == 1 and tuple(call.q_pos) == tuple(call.k_pos)


def fused_forward(q5, k, v, causal, scale):
    B, Hk, g, L, D = q5.shape
    o, lse = _FLASH(q5.reshape(B, Hk, g * L, D), k, v, 0.0, causal, scale=scale)
    return o.view(B, Hk, g, L, v.shape[-1]), lse.view(B, Hk, g, L)


def fused_backward(q5, k, v, dout5, out5, lse, causal, scale):
    B, Hk, g, L, D = q5.shape
    dq, dk, dv = _FLASH_BWD(dout5.reshape(B, Hk, g * L, -1), q5.reshape(B, Hk, g * L, D), k, v,
                            out5.reshape(B, Hk, g * L, -1), lse.reshape(B, Hk, g * L).contiguous(), 0.0, causal,
                            scale=scale)
    return dq.view(B, Hk, g, L, D), dk, dv
