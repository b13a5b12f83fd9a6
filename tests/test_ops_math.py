"""Elementwise, matmul-family, reduction and in-place ops on DTensors: parity sweeps.

Values and gradients equal the single-process computation on full tensors for every
combination of input placements in the sweep (Shard / Replicate / Partial) on 2 and 4
ranks and a (2, 2) mesh, with uneven sizes (5, 7 on 2/4 ranks).
"""
import itertools

import torch
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from tests._parity import TOL, _check, _meshes, _no_comm, _placements, _randn

LOOSE = dict(rtol=1e-10, atol=1e-10)


def _pairs(mesh, nd_a, nd_b, partial=True):
    return list(itertools.product(_placements(mesh, nd_a, partial), _placements(mesh, nd_b, partial)))


def _elementwise_body():
    n = 0
    a, b, c = _randn(5, 7, seed=1), _randn(5, 7, seed=2), _randn(7, seed=3)
    unary = {
        "relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
        "softplus": F.softplus, "neg": lambda x: -x, "exp": torch.exp, "abs": torch.abs,
        "clamp": lambda x: x.clamp(-0.5, 0.7), "scalar_ops": lambda x: (2.0 * x - 1.0) / 3.0 + x ** 2,
        "cast": lambda x: x.float().double(), "masked_fill": lambda x: x.masked_fill(x > 0.5, 0.0),
    }
    for mesh in _meshes():
        for name, f in unary.items():
            for pl in _placements(mesh, 2):
                # casting Partial pieces to fp32 rounds each piece: fp32 tolerance for that case
                _check(name, mesh, f, [(a, pl)], tol=dict(rtol=1e-6, atol=1e-6) if name == "cast" else TOL)
                n += 1
        binary = {
            "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
            "div": lambda x, y: x / (y.abs() + 1), "where": lambda x, y: torch.where(x > y, x, y * 2),
            "maximum": torch.maximum, "cmp": lambda x, y: (x < y).double() * (x + y),
        }
        for name, f in binary.items():
            for pa, pb in _pairs(mesh, 2, 2):
                _check(name, mesh, f, [(a, pa), (b, pb)])
                n += 1
            for pa, pc in _pairs(mesh, 2, 1):     # broadcasting a row vector
                _check(name + "_bcast", mesh, f, [(a, pa), (c, pc)])
                n += 1
        # partial stays partial through linear ops, without communication
        pl = [Partial()] + [Replicate()] * (mesh.ndim - 1)
        rp = [Replicate()] * mesh.ndim
        _check("P+P", mesh, lambda x, y: _no_comm(lambda: x + y),
               [(a, pl), (b, pl)], check_out=lambda o: _expect(o, pl))
        _check("P*R", mesh, lambda x, y: _no_comm(lambda: x * y),
               [(a, pl), (b, rp)], check_out=lambda o: _expect(o, pl))
        _check("P+R", mesh, lambda x, y: x + y, [(a, pl), (b, rp)], check_out=lambda o: _expect(o, pl))
    return n


def _expect(out, pl):
    assert tuple(out.placements) == tuple(pl), (out.placements, pl)


def test_elementwise(dist_runner):
    assert dist_runner.run(2, _elementwise_body)[0] > 100
    dist_runner.run(4, _elementwise_body)


def _matmul_body():
    n = 0
    A, B = _randn(5, 6, seed=1), _randn(6, 7, seed=2)
    bA, bB = _randn(3, 5, 6, seed=3), _randn(3, 6, 7, seed=4)
    bias, bias2 = _randn(7, seed=5), _randn(5, 7, seed=6)
    x3, w = _randn(2, 5, 6, seed=7), _randn(7, 6, seed=8)
    v = _randn(6, seed=9)
    for mesh in _meshes():
        for pa, pb in _pairs(mesh, 2, 2):
            _check("mm", mesh, torch.mm, [(A, pa), (B, pb)])
            _check("matmul", mesh, torch.matmul, [(A, pa), (B, pb)])
            _check("einsum", mesh, lambda x, y: torch.einsum("ik,kj->ij", x, y), [(A, pa), (B, pb)])
            _check("addmm", mesh, lambda x, y, z: torch.addmm(z, x, y, beta=0.5, alpha=2.0),
                   [(A, pa), (B, pb), (bias2, [Replicate() if q.is_partial() else q for q in pa])])
            n += 4
        for pa, pb in _pairs(mesh, 3, 3, partial=False):
            _check("bmm", mesh, torch.bmm, [(bA, pa), (bB, pb)])
            _check("baddbmm", mesh, lambda x, y: torch.baddbmm(torch.zeros(3, 5, 7, dtype=x.dtype), x, y)
                   if not isinstance(x, hp.DTensor) else torch.baddbmm(hp.zeros(3, 5, 7, device_mesh=mesh,
                   placements=[Replicate()] * mesh.ndim, dtype=x.dtype), x, y), [(bA, pa), (bB, pb)])
            _check("einsum_b", mesh, lambda x, y: torch.einsum("bik,bkj->bij", x, y), [(bA, pa), (bB, pb)])
            n += 3
        for px, pw in _pairs(mesh, 3, 2):
            for pb in _placements(mesh, 1, partial=False):
                _check("linear", mesh, F.linear, [(x3, px), (w, pw), (bias, pb)])
                n += 1
        for pa, pv in _pairs(mesh, 2, 1):
            _check("mv", mesh, torch.matmul, [(A, pa), (v, pv)])
            n += 1
        # column x row parallel: S(1) activations @ S(0) weight -> Partial, no communication
        _check("rowwise", mesh, lambda x, y: _no_comm(lambda: x @ y),
               [(A, [Shard(1)] + [Replicate()] * (mesh.ndim - 1)), (B, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))],
               check_out=lambda o: _expect(o, [Partial()] + [Replicate()] * (mesh.ndim - 1)))
    return n


def test_matmul_family(dist_runner):
    dist_runner.run(2, _matmul_body)
    dist_runner.run(4, _matmul_body)


def _reduction_body():
    n = 0
    x = _randn(5, 7, seed=1)
    pos = x.abs() + 0.5
    red = {
        "sum": lambda t: t.sum(), "sum0": lambda t: t.sum(0), "sum1k": lambda t: t.sum(1, keepdim=True),
        "mean": lambda t: t.mean(), "mean0": lambda t: t.mean(0), "mean1": lambda t: torch.mean(t, dim=1),
        "max": lambda t: t.max(), "max_dim": lambda t: t.max(dim=1).values, "amax": lambda t: t.amax(0),
        "min": lambda t: torch.min(t, 0).values, "norm": lambda t: t.norm(), "norm1": lambda t: t.norm(dim=1),
        "vector_norm_inf": lambda t: torch.linalg.vector_norm(t, float("inf")),
        "cumsum": lambda t: t.cumsum(1),
    }
    for mesh in _meshes():
        for name, f in red.items():
            for pl in _placements(mesh, 2):
                _check(name, mesh, f, [(x, pl)], tol=LOOSE)
                n += 1
        for pl in _placements(mesh, 2):
            _check("prod", mesh, lambda t: t.prod(1), [(pos, pl)], tol=LOOSE)
            _check("argmax", mesh, lambda t: t.argmax(1), [(x, pl)], grad=False)
            n += 2
        # linear reductions over a sharded dim give Partial with no communication; mean is exact (uneven)
        s = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
        p = [Partial()] + [Replicate()] * (mesh.ndim - 1)
        _check("sum_partial", mesh, lambda t: _no_comm(lambda: t.sum(0)), [(x, s)], check_out=lambda o: _expect(o, p))
        _check("mean_partial", mesh, lambda t: _no_comm(lambda: t.mean()), [(x, s)], check_out=lambda o: _expect(o, p))
    return n


def test_reductions(dist_runner):
    dist_runner.run(2, _reduction_body)
    dist_runner.run(4, _reduction_body)


def _inplace_body():
    for mesh in _meshes():
        for pl in _placements(mesh, 2, partial=False):
            x = _randn(5, 7, seed=1)
            y = _randn(5, 7, seed=2)
            d = hp.distribute_tensor(x, mesh, pl)
            e = hp.distribute_tensor(y, mesh, [Replicate()] * mesh.ndim)
            with torch.no_grad():
                d.add_(e, alpha=2.0).mul_(0.5)
                ref = (x + 2.0 * y) * 0.5
                torch.testing.assert_close(d.full_tensor(), ref, **TOL)
                d.copy_(e)
                torch.testing.assert_close(d.full_tensor(), y, **TOL)
                d.zero_()
                assert d.full_tensor().abs().sum() == 0
                d.fill_(3.0)
                torch.testing.assert_close(d.full_tensor(), torch.full((5, 7), 3.0, dtype=x.dtype))
                assert tuple(d.placements) == tuple(pl)
                # random init is layout-independent
                hp.manual_seed(7)
                d.normal_(0.0, 2.0)
                hp.manual_seed(7)
                r = hp.zeros(5, 7, device_mesh=mesh, placements=[Replicate()] * mesh.ndim, dtype=x.dtype)
                r.normal_(0.0, 2.0)
                torch.testing.assert_close(d.full_tensor(), r.full_tensor(), **TOL)
                hp.manual_seed(8)
                d.uniform_(-1.0, 1.0)
                f = d.full_tensor()
                assert f.min() >= -1 and f.max() <= 1 and f.std() > 0.2


def test_inplace_ops(dist_runner):
    dist_runner.run(2, _inplace_body)
    dist_runner.run(4, _inplace_body)
