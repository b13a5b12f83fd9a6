"""Context-parallel attention (issue 23): ring, Ulysses and hybrid against full attention in one process.

Every case builds the whole q/k/v (float64, seeded) on every rank, computes
``F.scaled_dot_product_attention`` on them in this process (the reference: values and dQ/dK/dV),
shards them with ``cp_shard``, runs the context-parallel attention on the shards, backpropagates
the same weighted sum, and compares the ``cp_unshard``-ed output and gradients at 1e-10.
"""
import pytest


TOL = 1e-10


def _ref_mask(kind, S, torch, cu=None, window=None):
    i = torch.arange(S).unsqueeze(-1)
    j = torch.arange(S).unsqueeze(0)
    if kind == "none":
        return None
    if kind == "causal":
        return j <= i
    if kind == "window":
        return (j <= i) & (j > i - window)
    if kind == "document":
        cu_t = torch.tensor(cu)
        di = torch.searchsorted(cu_t, i, right=True)
        dj = torch.searchsorted(cu_t, j, right=True)
        return (di == dj) & (j <= i)
    raise ValueError(kind)


def _attn_case(method, cp_shape, S, mask_kind, lb, hq, hk, rotate, seed=0, dtensor=False):
    import torch
    import torch.nn.functional as F
    import hyper_parallel as hp
    from hyper_parallel.context_parallel import (DocumentMask, SlidingWindowMask, context_parallel_attention,
                                                 cp_shard, cp_unshard)
    mesh = hp.init_device_mesh("cpu", cp_shape)
    g = torch.Generator().manual_seed(seed)
    B, D = 2, 4
    dt = torch.float64
    q = torch.randn(B, hq, S, D, dtype=dt, generator=g)
    k = torch.randn(B, hk, S, D, dtype=dt, generator=g)
    dv = D + S % 2         # odd lengths: value head dim != query's (the explicit kernel); even: torch's fused one
    v = torch.randn(B, hk, S, dv, dtype=dt, generator=g)
    w = torch.randn(B, hq, S, dv, dtype=dt, generator=g)
    cu = window = None
    if mask_kind == "document":
        cu = (0, S // 5, S // 5 + S // 2, S)        # 3 packed documents of unequal lengths
        mask = DocumentMask(cu)
    elif mask_kind == "window":
        window = max(2, S // 3)
        mask = SlidingWindowMask(window)
    else:
        mask = mask_kind
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=_ref_mask(mask_kind, S, torch, cu, window),
                                         enable_gqa=hq != hk)
    (ref * w).sum().backward()
    if dtensor:
        from hyper_parallel import Shard, DTensor, distribute_tensor
        pl = [Shard(2)] * len(cp_shape)
        ql, kl, vl = (distribute_tensor(t, mesh, pl).requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(ql, kl, vl, method=method, mask=mask, rotate=rotate)
        assert isinstance(out, DTensor) and tuple(out.placements) == tuple(pl)
        (out * distribute_tensor(w, mesh, pl)).sum().backward()
        res = [out.full_tensor().detach(), ql.grad.full_tensor(), kl.grad.full_tensor(), vl.grad.full_tensor()]
    else:
        ql, kl, vl, wl = cp_shard(mesh, [q, k, v, w], [2, 2, 2, 2], load_balance=lb)
        for t in (ql, kl, vl):
            t.requires_grad_()
        out = context_parallel_attention(ql, kl, vl, mesh, method=method, mask=mask, load_balance=lb,
                                         rotate=rotate)
        (out * wl).sum().backward()
        res = cp_unshard(mesh, [out.detach(), ql.grad, kl.grad, vl.grad], [2, 2, 2, 2], load_balance=lb)
    errs = [float((a - b).abs().max()) for a, b in zip(res, [ref.detach(), qr.grad, kr.grad, vr.grad])]
    assert max(errs) < TOL, (method, cp_shape, S, mask_kind, lb, hq, hk, rotate, errs)
    return max(errs)


# a sampled sweep: (method, mesh, seq, mask, load_balance, q heads, kv heads, rotation)
CASES = [
    ("ring", (2,), 16, "causal", True, 4, 4, "p2p"),
    ("ring", (2,), 13, "causal", True, 4, 2, "allgather"),       # not divisible by 2*cp, GQA
    ("ring", (2,), 12, "none", False, 2, 2, "p2p"),
    ("ring", (2,), 15, "none", True, 2, 2, "p2p"),
    ("ring", (4,), 19, "causal", True, 4, 1, "p2p"),             # MQA, uneven
    ("ring", (4,), 16, "causal", False, 4, 2, "allgather"),
    ("ring", (4,), 24, "none", True, 2, 2, "allgather"),
    ("ring", (4,), 30, "document", True, 2, 2, "p2p"),
    ("ring", (2,), 18, "window", True, 2, 1, "p2p"),
    ("ulysses", (2,), 16, "causal", True, 4, 2, "p2p"),
    ("ulysses", (2,), 11, "none", False, 3, 3, "p2p"),          # uneven heads and sequence
    ("ulysses", (4,), 16, "causal", False, 4, 1, "p2p"),         # MQA: kv heads < cp replicated
    ("ulysses", (4,), 22, "causal", True, 6, 2, "p2p"),          # uneven heads (6 over 4), GQA
    ("ulysses", (4,), 30, "document", True, 4, 4, "p2p"),
    ("hybrid", (2, 2), 16, "causal", True, 4, 2, "p2p"),
    ("hybrid", (2, 2), 21, "causal", False, 2, 2, "allgather"),
    ("hybrid", (2, 2), 24, "none", True, 4, 4, "p2p"),
    ("hybrid", (2, 2), 26, "document", True, 4, 2, "p2p"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_attention_parity(dist_runner, case):
    method, shape, *rest = case
    ws = 1
    for s in shape:
        ws *= s
    dist_runner.run(ws, _attn_case, method, shape, *rest)


@pytest.mark.parametrize("method,shape", [("ring", (4,)), ("ulysses", (2,)), ("hybrid", (2, 2))])
def test_dtensor_inputs(dist_runner, method, shape):
    """Sequence-sharded DTensors (natural order, torch.chunk shards) in, a DTensor of the same layout out."""
    ws = 4 if len(shape) == 2 or shape[0] == 4 else 2
    dist_runner.run(ws, _attn_case, method, shape, 18, "causal", False, 4, 2, "p2p", 1, True)


# ----------------------------------------------------------------------------- layout and schedule math (no processes)
def test_layouts():
    from hyper_parallel.context_parallel.plan import positions, restore_index, seg_len, shard_layout
    for cp in (1, 2, 3, 4, 8):
        for S in range(cp, 70):
            for lb in (False, True):
                lay = shard_layout(S, cp, lb)
                lens = [seg_len(s) for s in lay]
                assert sum(lens) == S and max(lens) - min(lens) <= 1, (S, cp, lb, lens)
                allpos = sorted(p for segs in lay for p in positions(segs))
                assert allpos == list(range(S))                         # each position once, no padding
                idx = restore_index(lay)
                flat = [p for segs in lay for p in positions(segs)]
                assert [flat[i] for i in idx] == list(range(S))
                if lb and S % (2 * cp) == 0:                           # rank r: chunks r and 2cp-1-r
                    c = S // (2 * cp)
                    assert all(lay[r] == [(r * c, c), ((2 * cp - 1 - r) * c, c)] for r in range(cp))
    with pytest.raises(ValueError, match="sequence length 3 is smaller than the cp degree 4"):
        shard_layout(3, 4, True)


def test_load_balanced_causal_work():
    """Head-tail: causal score entries computed per rank within 10% of equal (even when S % 2cp != 0);
    contiguous shards: rank cp-1 computes cp blocks where rank 0 computes one. Fully masked blocks are never computed."""
    from hyper_parallel.context_parallel.masks import CausalMask, DocumentMask, ring_schedule, schedule_work
    from hyper_parallel.context_parallel.plan import shard_layout
    for cp in (2, 4, 8):
        for S in (64 * cp, 64 * cp + 3, 64 * cp + 2 * cp - 1):
            work = [schedule_work(ring_schedule(shard_layout(S, cp, True), me, CausalMask())) for me in range(cp)]
            assert max(work) / min(work) <= 1.10, (cp, S, work)
            total = sum(work)
            assert total < 0.5 * S * S * 1.3       # about half the square: the masked half is skipped
            plain = [schedule_work(ring_schedule(shard_layout(S, cp, False), me, CausalMask())) for me in range(cp)]
            assert max(plain) / min(plain) >= 0.9 * cp      # (diagonal blocks counted whole)
    # document masking: blocks of other documents are skipped
    S, cp = 64, 4
    docs = DocumentMask((0, 16, 48, 64))
    work = sum(schedule_work(ring_schedule(shard_layout(S, cp, False), me, docs)) for me in range(cp))
    causal = sum(schedule_work(ring_schedule(shard_layout(S, cp, False), me, CausalMask())) for me in range(cp))
    assert work < causal


def _low_precision(dtype_name, tol):
    import torch
    import torch.nn.functional as F
    import hyper_parallel as hp
    from hyper_parallel.context_parallel import context_parallel_attention, cp_shard, cp_unshard
    dt = getattr(torch, dtype_name)
    mesh = hp.init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(1)
    full = [torch.randn(1, 4, 37, 16, dtype=torch.float64, generator=g) for _ in range(3)]
    ref = [t.clone().requires_grad_() for t in full]
    out_ref = F.scaled_dot_product_attention(*ref, is_causal=True)
    out_ref.sum().backward()
    sh = [t.to(dt).requires_grad_() for t in cp_shard(mesh, full, [2, 2, 2])]
    for rotate in ("p2p", "allgather"):
        for t in sh:
            t.grad = None
        out = context_parallel_attention(*sh, mesh, is_causal=True, rotate=rotate)
        assert out.dtype == dt
        out.sum().backward()
        res = cp_unshard(mesh, [out.detach()] + [t.grad for t in sh], [2, 2, 2, 2])
        assert all(r.dtype == dt for r in res)
        errs = [float((a.double() - b).abs().max()) for a, b in zip(res, [out_ref.detach()] + [t.grad for t in ref])]
        assert max(errs) < tol, (dtype_name, rotate, errs)
    return True


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 5e-2)])
def test_low_precision(dist_runner, dtype, tol):
    """float32 and bfloat16 inputs (bf16 accumulated in float32) against the float64 reference."""
    dist_runner.run(2, _low_precision, dtype, tol)
