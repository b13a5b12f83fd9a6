"""torch 2.13's private CP helpers on hyper_parallel (issue 31 item 7): any sequence order is exact.

* The load balancers' indices (head-tail, per-document head-tail, PTRR) equal torch's, and
  ``_context_parallel_shard``'s shards equal torch's own ``_context_parallel_shard`` output (torch's
  real function, on a torch mesh) for every balancer, 2 and 4 ranks;
* with ``_enable_context_parallel_dispatcher()``, SDPA on sequence-sharded DTensors built the way
  torchtitan 0.3.0 builds them (``DTensor.from_local(x, cp_mesh, [Shard(1)])`` then ``transpose``):
  float64 values and q/k/v gradients of causal and non-causal attention, under each balancer
  (PTRR with an order varying along the batch too), equal one process's SDPA, laid out by torch's
  helper (1e-10), on a 1-D cp mesh and on the cp slices of a 2-D (dp, cp) mesh (two cp groups);
  and the same through ``context_parallel_attention(order=recorded_order(mesh))``;
* an unknown order (dispatcher on, nothing recorded), an order that does not fit the inputs, a
  non-permutation balancer and a ``BlockMask`` buffer raise, naming what was expected.
"""
import pytest

TOL = 1e-10
S, B, H, D = 32, 2, 4, 8


def _doc_mod(bounds):
    import torch

    def doc(pos):
        return sum((pos >= b).long() for b in bounds)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc(q_idx) == doc(kv_idx)) & (q_idx >= kv_idx)
    return mask_mod


def _block_mask(batch_varying):
    """A FlexAttention document-causal BlockMask (block size 4), one mask per batch row when asked."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    if not batch_varying:
        return create_block_mask(_doc_mod([8, 20]), 1, 1, S, S, device="cpu", BLOCK_SIZE=4)
    docs = torch.tensor([[8, 20], [4, 28]])

    def mod(b, h, q_idx, kv_idx):
        dq = (q_idx >= docs[b, 0]).long() + (q_idx >= docs[b, 1]).long()
        dk = (kv_idx >= docs[b, 0]).long() + (kv_idx >= docs[b, 1]).long()
        return (dq == dk) & (q_idx >= kv_idx)
    return create_block_mask(mod, B, 1, S, S, device="cpu", BLOCK_SIZE=4)


def _balancers(kind, cp):
    """(ours, torch's) load balancer of ``kind`` for cp ranks (None, None for no balancer)."""
    from torch.distributed.tensor.experimental import _attention as T
    from hyper_parallel.context_parallel import load_balancer as O
    if kind is None:
        return None, None
    if kind == "headtail":
        return O._HeadTailLoadBalancer(S, cp, "cpu"), T._HeadTailLoadBalancer(S, cp, "cpu")
    if kind == "perdoc":
        lens = [[8 * cp, S - 8 * cp]] if 8 * cp < S else [[S]]
        return O._PerDocumentHeadTailLoadBalancer(lens, cp, "cpu"), T._PerDocumentHeadTailLoadBalancer(lens, cp, "cpu")
    bm = _block_mask(kind == "ptrr_batch")
    return O._PTRRLoadBalancer(bm, cp), T._PTRRLoadBalancer(bm, cp)


KINDS = [None, "headtail", "perdoc", "ptrr", "ptrr_batch"]


def _shards_equal_torch(kinds):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard as torch_shard
    from hyper_parallel.context_parallel import order as order_mod
    from hyper_parallel.context_parallel.torch_private import _context_parallel_shard
    cp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(1)
    tokens, pos = torch.randint(0, 100, (B, S), generator=g), torch.arange(S)
    x = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    try:
        for kind in kinds:
            ours, theirs = _balancers(kind, cp)
            if ours is not None:
                for restore in (False, True):
                    assert torch.equal(ours._generate_indices(restore).long(), theirs._generate_indices(restore).long())
            bufs, dims = [tokens, x, tokens.clone()], [1, 2, 1]
            if kind != "ptrr_batch":
                bufs, dims = bufs + [pos], dims + [0]
            want = torch_shard(mesh, bufs, dims, load_balancer=theirs)
            for lb in ((ours, theirs) if ours is not None else (None,)):   # torch's balancer objects work too
                got = _context_parallel_shard(mesh, bufs, dims, load_balancer=lb)
                assert len(got) == len(want)
                for a, b in zip(got, want):
                    assert a.shape == b.shape and torch.equal(a, b), (kind, a.shape, b.shape)
            # a tuple of buffers comes back as a tuple (pytree), as torch's does
            assert isinstance(_context_parallel_shard(mesh, (tokens,), (1,), load_balancer=ours), tuple)
    finally:
        order_mod.forget()


@pytest.mark.parametrize("ws", [2, 4])
def test_shards_and_indices_equal_torch(dist_runner, ws):
    dist_runner.run(ws, _shards_equal_torch, KINDS)


def _attention_any_order(kinds, sliced=False):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard as torch_shard
    import hyper_parallel as hp
    from hyper_parallel.context_parallel import context_parallel_attention, order as order_mod, recorded_order
    from hyper_parallel.context_parallel.torch_private import (_context_parallel_shard,
                                                               _disable_context_parallel_dispatcher,
                                                               _enable_context_parallel_dispatcher)
    cp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    if sliced:   # the cp dim of a 2-D (dp, cp) torch mesh, as torchtitan slices it: two cp groups
        cp //= 2
        mesh = init_device_mesh("cpu", (2, cp), mesh_dim_names=("dp", "cp"))["cp"]
    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(4))  # (B, L, N, H)
    checked = 0
    try:
        for kind in kinds:
            ours, theirs = _balancers(kind, cp)
            for causal in (True, False):
                qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
                ref = F.scaled_dot_product_attention(qr.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2),
                                                     is_causal=causal).transpose(1, 2)
                ref.backward(dout)
                # what this rank must hold: torch's own helper lays the references out
                want = torch_shard(mesh, [ref.detach(), qr.grad, kr.grad, vr.grad], [1] * 4, load_balancer=theirs)
                ql, kl, vl, dl = _context_parallel_shard(mesh, [q, k, v, dout], [1] * 4, load_balancer=ours)
                ql, kl, vl = (t.clone().requires_grad_() for t in (ql, kl, vl))
                _enable_context_parallel_dispatcher()
                try:      # torchtitan's apply_cp_to_forward + ScaledDotProductAttention.forward
                    Q, K, V = (hp.DTensor.from_local(t, mesh, [hp.Shard(1)], run_check=False).transpose(1, 2)
                               for t in (ql, kl, vl))
                    out = F.scaled_dot_product_attention(Q, K, V, is_causal=causal).transpose(1, 2).to_local()
                finally:
                    _disable_context_parallel_dispatcher()
                out.backward(dl)
                for name, a, b in (("out", out, want[0]), ("dq", ql.grad, want[1]), ("dk", kl.grad, want[2]),
                                   ("dv", vl.grad, want[3])):
                    assert a.shape == b.shape and float((a - b).abs().max()) < TOL, (kind, causal, name)
                # hyper_parallel's own entry point, told the order explicitly
                o2 = context_parallel_attention(ql.detach().transpose(1, 2), kl.detach().transpose(1, 2),
                                                vl.detach().transpose(1, 2), mesh, is_causal=causal,
                                                order=recorded_order(mesh)).transpose(1, 2)
                assert float((o2 - want[0]).abs().max()) < TOL, (kind, causal, "order=")
                checked += 1
    finally:
        _disable_context_parallel_dispatcher()
        order_mod.forget()
    return checked


@pytest.mark.parametrize("ws", [2, 4])
def test_sdpa_exact_under_every_order(dist_runner, ws):
    assert dist_runner.run(ws, _attention_any_order, KINDS, timeout=300) == [2 * len(KINDS)] * ws


def test_sdpa_exact_on_cp_slices_of_a_2d_mesh(dist_runner):
    kinds = [None, "headtail", "ptrr"]
    assert dist_runner.run(4, _attention_any_order, kinds, True, timeout=300) == [2 * len(kinds)] * 4


def _errors():
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    import hyper_parallel as hp
    from hyper_parallel.context_parallel import context_parallel_attention, cp_shard, order as order_mod
    from hyper_parallel.context_parallel.load_balancer import _LoadBalancer
    from hyper_parallel.context_parallel.torch_private import (_context_parallel_shard,
                                                               _disable_context_parallel_dispatcher,
                                                               _enable_context_parallel_dispatcher)
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(1, S, H, D, dtype=torch.float64)
    order_mod.forget()

    def sdpa(t):
        T = hp.DTensor.from_local(t, mesh, [hp.Shard(1)], run_check=False).transpose(1, 2)
        return F.scaled_dot_product_attention(T, T, T, is_causal=True)
    _enable_context_parallel_dispatcher()
    try:
        with pytest.raises(RuntimeError, match="no sequence order is recorded"):
            sdpa(x[:, : S // 2])
        _context_parallel_shard(mesh, [x], [1])
        with pytest.raises(RuntimeError, match="holds 5 sequence rows, but the recorded order"):
            sdpa(x[:, :5])
    finally:
        _disable_context_parallel_dispatcher()

    class NotAPermutation(_LoadBalancer):
        def _generate_indices(self, restore=False):
            return torch.zeros(1, S, dtype=torch.long)
    with pytest.raises(ValueError, match="not a permutation"):
        _context_parallel_shard(mesh, [x], [1], load_balancer=NotAPermutation())
    with pytest.raises(NotImplementedError, match="BlockMask"):
        _context_parallel_shard(mesh, [x, _block_mask(False)], [1, 2])
    # hyper_parallel's attention checks the recorded order against its load_balance
    from hyper_parallel.context_parallel.load_balancer import _PTRRLoadBalancer
    (xs,) = _context_parallel_shard(mesh, [x], [1], load_balancer=_PTRRLoadBalancer(_block_mask(False), 2))
    with pytest.raises(ValueError, match="not in hyper_parallel's layout with load_balance=True"):
        t = xs.transpose(1, 2)
        context_parallel_attention(t, t, t, mesh, is_causal=True, load_balance=True)
    cp_shard(mesh, [x], [1], load_balance=True)   # a hyper_parallel layout recorded: that one is used
    order_mod.forget()
    return True


def test_unknown_or_unfitting_order_raises(dist_runner):
    assert dist_runner.run(2, _errors) == [True, True]
