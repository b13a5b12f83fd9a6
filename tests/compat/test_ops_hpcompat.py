"""Op rules added for HyperParallel programs: scatter family, index_add, masked_scatter, sort family,
isin, multinomial, and the ops of the HyperParallel sweep (docs/ops.md).

Values and gradients against one process over placement sweeps (Shard / Replicate / Partial) on
4 ranks: a (4,) and a (2, 2) mesh, uneven sizes (7, 6); plain index / mask tensors are taken as
replicated. multinomial is random: its draws are checked for support, distinctness, frequencies
and for being the same whatever the layout.
"""
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard

from tests.harness.parity import _check, _meshes, _no_comm, _placements, _randn


def _perm_index(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, cols, generator=g).argsort(dim=1)


def _scatter_body():
    x, src = _randn(7, 6), _randn(7, 6, seed=1)
    idx = _perm_index(7, 6, 2)                     # a permutation per row: no duplicate targets
    idx_small = torch.randint(0, 6, (7, 4), generator=torch.Generator().manual_seed(3))
    src_small = _randn(7, 4, seed=4)
    idx0 = _perm_index(6, 7, 5).t().contiguous()   # dim 0 permutations
    idx1d = torch.tensor([4, 0, 6])
    source = _randn(3, 6, seed=6)
    mask = torch.rand(7, 6, generator=torch.Generator().manual_seed(7)) > 0.5
    flat_src = _randn(42, seed=8)
    n = 0
    for mesh in _meshes():
        rep = [Replicate()] * mesh.ndim
        for pl in _placements(mesh, 2):
            _check("scatter", mesh, lambda a, s: torch.scatter(a, 1, idx, s), [(x, pl), (src, pl)])
            _check("scatter value", mesh, lambda a: a.scatter(1, idx, 2.5), [(x, pl)])
            _check("scatter dim0", mesh, lambda a, s: a.scatter(0, idx0, s), [(x, pl), (src, rep)])
            _check("scatter_add", mesh, lambda a, s: torch.scatter_add(a, 1, idx_small, s),
                   [(x, pl), (src_small, pl)])
            _check("scatter_reduce sum", mesh, lambda a, s: a.scatter_reduce(1, idx_small, s, "sum"),
                   [(x, pl), (src_small, rep)])
            _check("scatter_reduce amax", mesh,
                   lambda a, s: torch.scatter_reduce(a, 1, idx_small, s, reduce="amax", include_self=False),
                   [(x, pl), (src_small, pl)])
            _check("index_add", mesh, lambda a, s: a.index_add(0, idx1d, s, alpha=2.0), [(x, pl), (source, pl)])
            _check("masked_scatter", mesh, lambda a, s: a.masked_scatter(mask, s), [(x, pl), (flat_src, rep)])
            n += 8
        for pl in _placements(mesh, 2, partial=False):   # DTensor index laid out like the input
            _check("scatter dt index", mesh, lambda a, i, s: a.scatter(1, i, s), [(x, pl), (idx, pl), (src, pl)])
            _check("scatter_add dt index", mesh, lambda a, i, s: a.scatter_add(1, i, s),
                   [(x, pl), (idx_small, pl), (src_small, pl)])
            n += 2
        # in place on an unsharded scatter dim: no communication, layout kept
        t = hp.distribute_tensor(x, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
        s = hp.distribute_tensor(src, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
        _no_comm(lambda: t.scatter_(1, idx, s))
        torch.testing.assert_close(t.full_tensor(), x.scatter(1, idx, src))
        out = _no_comm(lambda: s.scatter_add(1, idx_small, s[:, :4]))
        assert out.placements == s.placements
    return n


def _sort_body():
    x = _randn(7, 6)
    ints = torch.randint(0, 10, (7, 6), generator=torch.Generator().manual_seed(1))
    tests = torch.tensor([1, 3, 5, 7, 11])
    n = 0
    for mesh in _meshes():
        for pl in _placements(mesh, 2):
            _check("sort", mesh, lambda a: a.sort(dim=1), [(x, pl)])
            _check("torch.sort desc", mesh, lambda a: torch.sort(a, 0, descending=True), [(x, pl)])
            _check("argsort", mesh, lambda a: a.argsort(dim=-1), [(x, pl)], grad=False)
            _check("topk", mesh, lambda a: torch.topk(a, 3, dim=1), [(x, pl)])
            _check("topk smallest dim0", mesh, lambda a: a.topk(2, dim=0, largest=False), [(x, pl)])
            _check("msort", mesh, lambda a: torch.msort(a), [(x, pl)])
            _check("kthvalue", mesh, lambda a: a.kthvalue(2, dim=1), [(x, pl)])
            n += 7
        rep = [Replicate()] * mesh.ndim
        for pl in _placements(mesh, 2, partial=False):
            _check("isin", mesh, lambda a: torch.isin(a, tests), [(ints, pl)])
            _check("isin dt test", mesh, lambda a, t: torch.isin(a, t, invert=True),
                   [(ints, pl), (tests, [Shard(0)] + rep[1:])])
            n += 2
        # a sort along an unsharded dim moves nothing
        d = hp.distribute_tensor(x, mesh, [Shard(0)] + rep[1:])
        vals, idx = _no_comm(lambda: d.sort(dim=1))
        assert vals.placements == d.placements and idx.placements == d.placements
    return n


def _multinomial_body():
    probs = torch.tensor([[0.1, 0.0, 0.4, 0.2, 0.3]] * 3 + [[0.0, 0.5, 0.0, 0.5, 0.0]] * 3, dtype=torch.float64)
    results = []
    for mesh in _meshes():
        rep = [Replicate()] * mesh.ndim
        for pl in ([Shard(0)] + rep[1:], rep, [Shard(1)] + rep[1:], rep[:-1] + [Shard(0)]):
            d = hp.distribute_tensor(probs, mesh, pl)
            hp.manual_seed(7)
            torch.manual_seed(7)  # replicated probabilities draw from torch's generator: seed every rank alike
            out = torch.multinomial(d, 2)
            assert isinstance(out, hp.DTensor) and out.shape == (6, 2) and out.dtype == torch.long
            full = out.full_tensor()
            assert (probs.gather(1, full) > 0).all(), full          # never a zero-probability class
            assert (full[:, 0] != full[:, 1]).all(), full           # without replacement: distinct
            if pl != rep:  # (replicated probabilities: torch.multinomial's draws, tests/dtensor/test_random_parity.py)
                results.append(full)
            if pl == rep:  # replicas hold identical draws
                seen = [None] * dist.get_world_size()
                dist.all_gather_object(seen, out.to_local().tolist())
                assert all(s == seen[0] for s in seen)
    for r in results[1:]:
        assert torch.equal(r, results[0])                           # the same draws whatever the layout
    mesh = _meshes()[0]
    p1 = hp.distribute_tensor(torch.tensor([0.1, 0.2, 0.0, 0.7], dtype=torch.float64), mesh, [Shard(0)])
    hp.manual_seed(3)
    s = torch.multinomial(p1, 4000, replacement=True).full_tensor()
    freq = torch.bincount(s, minlength=4).double() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.2, 0.0, 0.7], dtype=torch.float64), atol=0.03, rtol=0)
    return len(results)


def _extremum_body():
    x = _randn(5, 7, seed=11)
    short = _randn(3, 4, seed=12)                  # 3 rows over 4 ranks: one rank holds an empty shard
    ints = torch.randint(-50, 50, (6, 5), generator=torch.Generator().manual_seed(13))
    n = 0
    for mesh in _meshes():
        rep = [Replicate()] * mesh.ndim
        for pl in _placements(mesh, 2):
            _check("amax(1)", mesh, lambda t: t.amax(1), [(x, pl)])
            _check("amin(0, keepdim)", mesh, lambda t: torch.amin(t, 0, keepdim=True), [(x, pl)])
            _check("amax(dims)", mesh, lambda t: t.amax((0, 1)), [(x, pl)])
            _check("min()", mesh, lambda t: torch.min(t), [(x, pl)])
            _check("max() short", mesh, lambda t: t.max(), [(short, pl)])
            _check("amin(0) short", mesh, lambda t: t.amin(0), [(short, pl)])
            n += 6
        for pl in _placements(mesh, 2, partial=False):
            _check("int amax", mesh, lambda t: t.amax(0), [(ints, pl)])
            _check("int max()", mesh, lambda t: t.max(), [(ints, pl)])
            _check("max(dim) global indices", mesh, lambda t: t.max(dim=0), [(x, pl)])
            _check("min(dim) global indices", mesh, lambda t: torch.min(t, 1, keepdim=True), [(x, pl)])
            n += 4
        # a full max of a sharded tensor: local max, Partial(max); reducing it moves one value per rank
        sh = [Shard(0)] + rep[1:]
        d = hp.distribute_tensor(x, mesh, sh)
        m = _no_comm(lambda: d.max())
        assert m.placements == (Partial("max"),) + tuple(rep[1:]), m.placements
        a = _no_comm(lambda: d.amin(0))
        assert a.placements == (Partial("min"),) + tuple(rep[1:])
        with hp.CommDebugMode() as comm:
            torch.testing.assert_close(m.full_tensor(), x.max())
        assert comm.get_total_counts() == 1
        both = hp.distribute_tensor(x, mesh, [Shard(1)] + ([Shard(0)] if mesh.ndim == 2 else []))
        am = _no_comm(lambda: both.amax(1))
        assert am.placements[0] == Partial("max") and (mesh.ndim == 1 or am.placements[1] == Shard(0))
    return n


def _attention_body():
    F = torch.nn.functional
    sdpa = F.scaled_dot_product_attention
    q = _randn(2, 3, 9, 4, seed=21)                # 9 query rows: uneven over 2 and 4 ranks
    k = _randn(2, 3, 11, 4, seed=22)
    v = _randn(2, 3, 11, 6, seed=23)
    bmask = torch.rand(9, 11, generator=torch.Generator().manual_seed(24)) > 0.3
    bmask[:, 0] = True
    fmask = _randn(2, 1, 9, 11, seed=25)
    n = 0
    for mesh in _meshes():
        rep = [Replicate()] * mesh.ndim
        seq = [Shard(2)] + rep[1:]
        seq_pls = [seq] + ([[Shard(0), Shard(2)], [Shard(2), Shard(2)]] if mesh.ndim == 2 else [])
        for pl in seq_pls:
            _check("sdpa seq", mesh, lambda a, b, c: sdpa(a, b, c), [(q, pl), (k, rep), (v, rep)])
            _check("sdpa seq causal", mesh, lambda a, b, c: sdpa(a, b, c, is_causal=True), [(q, pl), (k, rep), (v, rep)])
            _check("sdpa seq plain bool mask", mesh, lambda a, b, c: sdpa(a, b, c, attn_mask=bmask),
                   [(q, pl), (k, rep), (v, rep)])
            _check("sdpa seq float mask", mesh, lambda a, b, c, m: sdpa(a, b, c, m, scale=0.5),
                   [(q, pl), (k, rep), (v, rep), (fmask, rep)])
            n += 4
        # the output stays sequence-sharded and nothing moves (K/V replicated, plain mask replicated)
        dq = hp.distribute_tensor(q, mesh, seq)
        dk, dv = (hp.distribute_tensor(t, mesh, rep) for t in (k, v))
        for kw in ({}, {"is_causal": True}, {"attn_mask": bmask}):
            o = _no_comm(lambda: sdpa(dq, dk, dv, **kw))
            assert o.placements == tuple(seq), (kw, o.placements)
            torch.testing.assert_close(o.full_tensor(), sdpa(q, k, v, **kw))
        # a plain mask is converted on every call, but the rule runs once (the call is cached)
        from hyper_parallel.dispatch import dispatcher as _op_dispatch
        sdpa(dq, dk, dv, attn_mask=bmask)
        misses = _op_dispatch._STATS["misses"]
        o = sdpa(dq, dk, dv, attn_mask=~bmask | (torch.arange(11) == 0))
        assert _op_dispatch._STATS["misses"] == misses
        torch.testing.assert_close(o.full_tensor(), sdpa(q, k, v, attn_mask=~bmask | (torch.arange(11) == 0)))
        # K/V sharded on the sequence too: they are gathered (PyTorch-style), the queries stay sharded
        ks = hp.distribute_tensor(k, mesh, seq)
        o = sdpa(dq, ks, dv, is_causal=True)
        assert o.placements == tuple(seq)
        torch.testing.assert_close(o.full_tensor(), sdpa(q, k, v, is_causal=True))
    return n


def _misc_body():
    F = torch.nn.functional
    x = _randn(7, 6, seed=31)
    a, b = _randn(7, seed=32), _randn(5, seed=33)
    ids = torch.randint(0, 5, (7, 6), generator=torch.Generator().manual_seed(34))
    img = _randn(4, 3, 6, 6, seed=35)
    w2 = _randn(4, 3, 3, 3, seed=36)
    bias = _randn(4, seed=37)
    sig = _randn(4, 3, 9, seed=38)
    w1 = _randn(6, 3, 2, seed=39)
    vol = _randn(2, 2, 4, 4, 4, seed=40)
    w3 = _randn(4, 2, 2, 2, 2, seed=41)
    n = 0
    for mesh in _meshes():
        rep = [Replicate()] * mesh.ndim
        for pl in _placements(mesh, 2):
            _check("pad", mesh, lambda t: F.pad(t, (1, 2)), [(x, pl)])
            _check("pad 2d reflect", mesh, lambda t: F.pad(t.unsqueeze(0), (1, 1, 2, 0), mode="reflect"), [(x, pl)])
            _check("pad value", mesh, lambda t: F.pad(t, (0, 0, 1, 1), value=0.5), [(x, pl)])
            _check("repeat_interleave", mesh, lambda t: t.repeat_interleave(2, dim=1), [(x, pl)])
            _check("repeat_interleave flat", mesh, lambda t: torch.repeat_interleave(t, 2), [(x, pl)])
            _check("vstack", mesh, lambda t, u: torch.vstack([t, u]), [(x, pl), (x, rep)])
            _check("hstack", mesh, lambda t, u: torch.hstack((t, u)), [(x, pl), (x, pl)])
            _check("atleast_3d", mesh, lambda t: torch.atleast_3d(t), [(x, pl)])
            n += 8
        for pl in _placements(mesh, 1):
            for pl2 in (rep, pl):
                _check("outer", mesh, lambda u, w: torch.outer(u, w), [(a, pl), (b, pl2)])
                n += 1
            _check("atleast_2d", mesh, lambda u: torch.atleast_2d(u), [(a, pl)])
            _check("histc", mesh, lambda u: torch.histc(u, bins=4, min=-2.0, max=2.0), [(a, pl)], grad=False)
            _check("histc data range", mesh, lambda u: torch.histc(u, bins=3), [(a, pl)], grad=False)
            n += 3
        for pl in _placements(mesh, 2, partial=False):
            _check("one_hot", mesh, lambda t: F.one_hot(t, 5), [(ids, pl)])
            _check("one_hot auto", mesh, lambda t: F.one_hot(t), [(ids, pl)])
            _check("nonzero", mesh, lambda t: torch.nonzero(t > 0), [(x, pl)], grad=False)
            n += 3
        for pl in ([Shard(0)] + rep[1:], rep, [Shard(1)] + rep[1:], rep[:-1] + [Shard(0)]):
            wpl = rep[:-1] + [Shard(0)]
            _check("conv2d", mesh, lambda t, w, c: F.conv2d(t, w, c, padding=1), [(img, pl), (w2, wpl), (bias, wpl)])
            _check("conv1d", mesh, lambda t, w: F.conv1d(t, w, stride=2), [(sig, pl), (w1, rep)])
            _check("conv3d", mesh, lambda t, w: F.conv3d(t, w), [(vol, pl), (w3, wpl)])
            n += 3
        # histc over a sharded input: a local count, Partial(sum), no communication
        da = hp.distribute_tensor(a, mesh, [Shard(0)] + rep[1:])
        h = _no_comm(lambda: torch.histc(da, 4, -2.0, 2.0))
        torch.testing.assert_close(h.full_tensor(), torch.histc(a, 4, -2.0, 2.0))
        assert h.placements == (Partial(),) + tuple(rep[1:])
        # conv with a batch-sharded input and an output-channel-sharded weight: no communication
        if mesh.ndim == 2:
            ci = hp.distribute_tensor(img, mesh, [Shard(0), Replicate()])
            cw = hp.distribute_tensor(w2, mesh, [Replicate(), Shard(0)])
            o = _no_comm(lambda: F.conv2d(ci, cw))
            assert o.placements == (Shard(0), Shard(1))
    return n


def _body():
    return (_scatter_body() + _sort_body() + _multinomial_body() + _extremum_body() + _attention_body()
            + _misc_body())


def test_hp_sweep_ops_4_ranks(dist_runner):
    counts = dist_runner.run(4, _body)
    assert min(counts) > 100
