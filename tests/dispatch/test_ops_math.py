"""Elementwise, matmul-family, reduction and in-place ops on DTensors: parity sweeps.

Values and gradients equal the single-process computation on full tensors for every
combination of input placements in the sweep (Shard / Replicate / Partial) on 2 and 4
ranks and a (2, 2) mesh, with uneven sizes (5, 7 on 2/4 ranks).
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from tests.harness.parity import TOL, _check, _make, _meshes, _no_comm, _placements, _randn

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
                # random init: layout-independent on shards, torch's own draws on a replicated tensor
                hp.manual_seed(7)
                torch.manual_seed(7)
                d.normal_(0.0, 2.0)
                hp.manual_seed(7)
                torch.manual_seed(7)
                if all(isinstance(q, Replicate) for q in pl):
                    ref = torch.zeros(5, 7, dtype=x.dtype).normal_(0.0, 2.0)
                else:
                    r = hp.zeros(5, 7, device_mesh=mesh, placements=[Shard(0)] * mesh.ndim, dtype=x.dtype)
                    r.normal_(0.0, 2.0)
                    ref = r.full_tensor()
                torch.testing.assert_close(d.full_tensor(), ref, **TOL)
                hp.manual_seed(8)
                d.uniform_(-1.0, 1.0)
                f = d.full_tensor()
                assert f.min() >= -1 and f.max() <= 1 and f.std() > 0.2


def test_inplace_ops(dist_runner):
    dist_runner.run(2, _inplace_body)
    dist_runner.run(4, _inplace_body)


# ----------------------------------------------------------------------------- broader op coverage
def _extra_math_body():
    n = 0
    R, S0, S1, S2, S3, P = Replicate(), Shard(0), Shard(1), Shard(2), Shard(3), Partial()
    for mesh in _meshes():
        def pad(*pl):   # placements on the first mesh dim(s), Replicate on the rest
            pl = list(pl)
            return pl + [R] * (mesh.ndim - len(pl)) if len(pl) <= mesh.ndim else pl[:mesh.ndim]
        two = mesh.ndim == 2
        # N-D batched and broadcast matmul
        x4, w2 = _randn(2, 3, 5, 6, seed=1), _randn(6, 7, seed=2)
        xb, yb = _randn(3, 1, 5, 6, seed=3), _randn(2, 6, 7, seed=4)
        for px, pw in [(pad(S0), pad(R)), (pad(S2, S1), pad(S1)), (pad(S1), pad(S0, S1)), (pad(P), pad(R)),
                       (pad(S3), pad(S0))]:
            _check("matmul_4d", mesh, torch.matmul, [(x4, px), (w2, pw)])
            n += 1
        for px, py in [(pad(S0), pad(S0)), (pad(S1), pad(S0)), (pad(S2, S0), pad(S2)), (pad(R), pad(P))]:
            _check("matmul_bcast", mesh, torch.matmul, [(xb, px), (yb, py)])
            _check("matmul_2d_3d", mesh, torch.matmul, [(x4[0, 0], pad(S0)), (yb, py)])
            n += 2
        # einsum patterns of attention / projections
        h, wd = _randn(2, 5, 6, seed=5), _randn(6, 4, seed=6)
        q, k = _randn(2, 3, 5, 4, seed=7), _randn(2, 3, 6, 4, seed=8)
        for ph, pw in [(pad(S0), pad(S1)), (pad(S2), pad(S0)), (pad(S1, S0), pad(R)), (pad(P), pad(R))]:
            _check("einsum_bsh_hd", mesh, lambda a, b: torch.einsum("bsh,hd->bsd", a, b), [(h, ph), (wd, pw)])
            n += 1
        for pq, pk in [(pad(S1), pad(S1)), (pad(S0, S1), pad(S0, S1)), (pad(S2), pad(S2)), (pad(S3), pad(R)),
                       (pad(S1), pad(S0))]:
            _check("einsum_qk", mesh, lambda a, b: torch.einsum("bhqd,bhkd->bhqk", a, b), [(q, pq), (k, pk)])
            n += 1
        # bmm / baddbmm with Partial inputs, beta/alpha, a bias that requires grad
        b1, b2, bias = _randn(3, 5, 6, seed=9), _randn(3, 6, 7, seed=10), _randn(3, 5, 7, seed=11)
        for p1, p2, pb in [(pad(P), pad(R), pad(R)), (pad(R), pad(P), pad(S0)), (pad(S2), pad(S1), pad(P)),
                           (pad(S0, P), pad(S0, R), pad(R, R)), (pad(P), pad(R), pad(P))]:
            _check("bmm", mesh, torch.bmm, [(b1, p1), (b2, p2)])
            _check("baddbmm", mesh, lambda m, a, b: torch.baddbmm(m, a, b, beta=0.5, alpha=-2.0),
                   [(bias, pb), (b1, p1), (b2, p2)])
            n += 2
        for pb, p1, p2 in [(pad(P), pad(S1), pad(S0)), (pad(R), pad(P), pad(R)), (pad(S1, P), pad(S0, S1), pad(R, S0))]:
            _check("addmm", mesh, lambda m, a, b: torch.addmm(m, a, b, beta=1.5, alpha=0.25),
                   [(bias[0], pb), (b1[0], p1), (b2[0], p2)])
            n += 1
        # comparisons other than <, casts
        a, b = (_randn(5, 7, seed=12) * 2).round(), (_randn(5, 7, seed=13) * 2).round()
        cmps = {"eq": lambda x, y: (x == y).double() * (x + y), "ge": lambda x, y: torch.where(x >= y, x, -y),
                "ne": lambda x, y: x.ne(y).to(x.dtype) * x * y, "ge_scalar": lambda x, y: (x >= 0.5).double() * x + y}
        for name, f in cmps.items():
            # (ties are exact only without Partial: summing Partial pieces may round; the last case has no ties)
            pairs = [(pad(S0), pad(S1)), (pad(S1, S0), pad(R)), (pad(R), pad(S0, S1))]
            for pa, pb in pairs + ([(pad(P), pad(R, P))] if name == "ge_scalar" else []):
                _check(name, mesh, f, [(a, pa), (b, pb)])
                n += 1
        a = a + 0.3     # casts: no value within rounding error of an integer
        for pl in [pad(S0), pad(P), pad(R, S1), pad(S1, P)]:
            _check("to_int", mesh, lambda x: (x * 3).int(), [(a, pl)], grad=False)
            _check("to_bool", mesh, lambda x: x.bool(), [(a, pl)], grad=False)
            _check("to_long_back", mesh, lambda x: x.long().to(torch.float64) * x, [(a, pl)])
            _check("to_dtype", mesh, lambda x: x.to(torch.float32).to(dtype=torch.float64) + x, [(a, pl)],
                   tol=dict(rtol=1e-6, atol=1e-6))
            # integer casts of Partial inputs: the sum is cast, not each piece
            # (torch.Tensor.to: the dispatched op; the DTensor.to method is core/dtensor's)
            _check("to_int_dtype", mesh, lambda x: torch.Tensor.to(x * 0.7, torch.int64), [(a, pl)], grad=False)
            _check("type_int", mesh, lambda x: (x * 0.7).type(torch.int32), [(a, pl)], grad=False)
            n += 6
        # masked_fill with a mask laid out differently from the input
        x = _randn(5, 7, seed=14)
        mask = _randn(5, 7, seed=15) > 0.3
        row_mask = _randn(7, seed=16) > 0
        for px, pm in [(pad(S0), pad(S1)), (pad(S1), pad(S0)), (pad(S0, S1), pad(S1, S0)), (pad(P), pad(S0)),
                       (pad(R), pad(S1))]:
            _check("masked_fill", mesh, lambda t, m: t.masked_fill(m, -1.5) * 2, [(x, px), (mask, pm)])
            _check("masked_fill_row", mesh, lambda t, m: t.masked_fill(m, 0.0),
                   [(x, px), (row_mask, pad(S0) if pm[0] == S1 else pad(R))])
            n += 2
        # prod over every dim, with negative values and zeros (exact, incl. gradients)
        z = _randn(5, 7, seed=17)
        z[1, 2] = 0.0
        z[3, :] = -z[3, :].abs()
        z[4, 5] = 0.0
        z[4, 6] = 0.0     # two zeros in one row: zero gradient there
        for pl in [pad(S0), pad(S1), pad(P), pad(S1, S0), pad(R, P)]:
            _check("prod0", mesh, lambda t: t.prod(0), [(z, pl)], tol=LOOSE)
            _check("prod1k", mesh, lambda t: t.prod(1, keepdim=True), [(z, pl)], tol=LOOSE)
            _check("prod_all", mesh, lambda t: t[:, :4].prod(), [(z, pl)], tol=LOOSE)
            n += 3
        # in-place ops on Partial targets (Partial(sum) semantics: the pieces sum to the value)
        p_pl = pad(P)
        y = _randn(5, 7, seed=18)
        for op, ref in [(lambda t: t.add_(2.5), lambda t: t + 2.5), (lambda t: t.sub_(1), lambda t: t - 1),
                        (lambda t: t.__iadd__(0.5), lambda t: t + 0.5), (lambda t: t.mul_(-3.0), lambda t: t * -3.0)]:
            d = _make(y, mesh, p_pl, False)
            with hp.CommDebugMode() as comm:
                out = op(d)
            assert out is d and tuple(d.placements) == tuple(p_pl), d.placements
            assert comm.get_total_counts() == 0, comm.get_comm_counts()
            torch.testing.assert_close(d.full_tensor(), ref(y), **TOL)
            n += 1
        # a replicated target with a Partial operand: the operand is reduced, the target keeps its layout
        for op in (lambda t, o: t.mul_(o), lambda t, o: t.add_(o), lambda t, o: t.copy_(o)):
            r = hp.distribute_tensor(y.clone(), mesh, pad(R))
            op(r, _make(x, mesh, p_pl, False))
            assert tuple(r.placements) == tuple(pad(R))
            torch.testing.assert_close(r.full_tensor(), op(y.clone(), x), **TOL)
            n += 1
        d = _make(y, mesh, p_pl, False)
        with pytest.raises(RuntimeError, match="clamp_.*Partial"):
            d.clamp_(0.0, 1.0)          # nonlinear: needs the sum first; in place it cannot change layout
    return n


def test_extra_math(dist_runner):
    assert dist_runner.run(4, _extra_math_body)[0] > 120
