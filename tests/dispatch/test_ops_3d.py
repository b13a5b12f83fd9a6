"""Ops on a 3-D mesh (2, 2, 2): one 8-rank run, a lean placement sweep per op family.

Values and gradients equal the single-process computation on full tensors (fp64,
tight tolerance), with uneven sizes (5, 7 over 2 or 4 pieces), tensor dims
sharded over two mesh dims at once, and Partial inputs on every mesh dim.
"""
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from tests.harness.parity import _check, _no_comm, _randn

R, P = Replicate(), Partial()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)


def _pl2():
    """Placements of a 2-D tensor on the 3-D mesh: each mesh dim Shard/Replicate/Partial somewhere."""
    return [[S0, S1, R], [R, S0, S1], [S1, R, S0], [S0, S0, R], [S1, S1, S0], [P, S0, R], [R, R, P]]


def _pl1():
    return [[S0, R, R], [R, S0, S0], [R, R, R], [R, P, R]]


def _3d_body():
    mesh = hp.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    n = 0
    a, b, c = _randn(5, 7, seed=1), _randn(5, 7, seed=2), _randn(7, seed=3)
    # elementwise binary, with broadcasting of a row vector
    pl2, pl1 = _pl2(), _pl1()
    for pa, pb in [(pl2[0], pl2[1]), (pl2[3], pl2[4]), (pl2[5], pl2[0]), (pl2[6], pl2[6])]:
        _check("mul", mesh, lambda x, y: x * y + y, [(a, pa), (b, pb)])
        n += 1
    for pa, pc in zip([pl2[1], pl2[2], pl2[4], pl2[5]], pl1):
        _check("add_bcast", mesh, lambda x, y: (x + y).tanh(), [(a, pa), (c, pc)])
        n += 1
    # matmul / linear (bias follows the output, added once when the output is Partial)
    A, B = _randn(5, 6, seed=4), _randn(6, 7, seed=5)
    x3, w, bias = _randn(3, 5, 6, seed=6), _randn(7, 6, seed=7), _randn(7, seed=8)
    # (the last pair has no communication-free strategy: every combination is priced by the planner)
    for pa, pb in [(pl2[0], pl2[1]), (pl2[1], pl2[2]), (pl2[3], pl2[4])]:
        _check("matmul", mesh, torch.matmul, [(A, pa), (B, pb)])
        n += 1
    for px, pw, pbias in [([S0, S2, R], [R, R, S0], [R, R, S0]), ([S0, R, S2], [R, R, S1], [R, R, R]),
                          ([P, R, S2], [R, R, S1], [R, R, R])]:
        _check("linear", mesh, F.linear, [(x3, px), (w, pw), (bias, pbias)])
        n += 1
    # column x row parallel on the tp dim: Partial output, no communication
    _check("rowwise", mesh, lambda x, y: _no_comm(lambda: x @ y), [(A, [S0, R, S1]), (B, [R, R, S0])],
           check_out=lambda o: _expect(o, [S0, R, P]))
    # reductions: sum over sharded dims -> Partial on those mesh dims, without communication
    _check("sum_partial", mesh, lambda t: _no_comm(lambda: t.sum(0)), [(a, [S0, S1, S0])],
           check_out=lambda o: _expect(o, [P, S0, P]))
    _check("mean_partial", mesh, lambda t: _no_comm(lambda: t.mean()), [(a, [S0, S1, R])],
           check_out=lambda o: _expect(o, [P, P, R]))
    for pl in (pl2[2], pl2[4]):
        _check("sum1", mesh, lambda t: t.sum(1), [(a, pl)])
        _check("amax0", mesh, lambda t: t.amax(0), [(a, pl)])
        n += 2
    # softmax (the softmax dim is unsharded first), layer_norm
    lw, lb = _randn(7, seed=9), _randn(7, seed=10)
    for pl in (pl2[0], pl2[4], pl2[5]):
        _check("softmax", mesh, lambda t: F.softmax(t, -1), [(a, pl)])
        n += 1
    _check("log_softmax0", mesh, lambda t: F.log_softmax(t, 0), [(a, pl2[1])])
    for pl, pw in [(pl2[0], [R, R, R]), (pl2[3], [R, S0, R])]:
        _check("layer_norm", mesh, lambda t, w_, b_: F.layer_norm(t, (7,), w_, b_), [(a, pl), (lw, pw), (lb, pw)])
        n += 1
    # views: split / merge of a sharded dim
    v = _randn(4, 6, seed=11)
    for pl in [[S1, S0, S1], [S0, S0, R]]:
        _check("view_split", mesh, lambda t: t.reshape(4, 2, 3).transpose(0, 1), [(v, pl)])
        _check("flatten", mesh, lambda t: t.flatten() * 2, [(v, pl)])
        n += 2
    # cat along a sharded and an unsharded dim
    for pa, pb in [([S0, S1, R], [S1, R, S0]), ([P, R, S1], [P, R, S1])]:
        _check("cat0", mesh, lambda x, y: torch.cat([x, y], 0), [(a, pa), (b, pb)])
        _check("cat1", mesh, lambda x, y: torch.cat([x, y], 1), [(a, pa), (b, pb)])
        n += 2
    # embedding: vocab-parallel rows, sharded embedding dim, sharded ids
    ids = torch.randint(0, 10, (3, 4), generator=torch.Generator().manual_seed(12))
    table = _randn(10, 6, seed=13)
    for pi, pw in [([S0, R, R], [R, R, S0]), ([S0, S1, R], [R, R, S1]), ([R, R, R], [S0, S1, S1]),
                   ([R, S0, R], [S1, S0, R])]:
        _check("embedding", mesh, lambda i, t: F.embedding(i, t), [(ids, pi), (table, pw)])
        n += 1
    return n


def _expect(out, pl):
    assert tuple(out.placements) == tuple(pl), (out.placements, pl)


def test_ops_on_3d_mesh(dist_runner):
    assert dist_runner.run(8, _3d_body)[0] >= 35
