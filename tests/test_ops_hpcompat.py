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

from tests._parity import _check, _meshes, _no_comm, _placements, _randn


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
            out = torch.multinomial(d, 2)
            assert isinstance(out, hp.DTensor) and out.shape == (6, 2) and out.dtype == torch.long
            full = out.full_tensor()
            assert (probs.gather(1, full) > 0).all(), full          # never a zero-probability class
            assert (full[:, 0] != full[:, 1]).all(), full           # without replacement: distinct
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


def _body():
    return _scatter_body() + _sort_body() + _multinomial_body()


def test_hp_sweep_ops_4_ranks(dist_runner):
    counts = dist_runner.run(4, _body)
    assert min(counts) > 100
