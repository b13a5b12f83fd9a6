"""Tensor manipulation ops on DTensors: cat/stack, split family, indexing, dim-wise ops, factories.

Every case compares values and gradients with the single-process computation on
full tensors over sweeps of placements (Shard / Replicate / Partial) on 2 and 4
ranks and a (2, 2) mesh, with uneven sizes (3, 5, 7).
"""
import torch

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard

from tests.harness.parity import _check, _make, _meshes, _no_comm, _placements, _randn, _sweep


# ----------------------------------------------------------------------------- bodies
def _join_body():
    a, b, c = _randn(7, 5), _randn(3, 5, seed=1), _randn(7, 5, seed=2)
    n = 0
    for mesh in _meshes():
        pls = _placements(mesh, 2)
        for pa in pls:
            for pb in ((pls[-1], pa) if mesh.ndim == 1 else (pa,)):
                _check("cat dim0", mesh, lambda x, y: torch.cat([x, y]), [(a, pa), (b, pb)])
                _check("concat dim1", mesh, lambda x, y: torch.concat((x, y), dim=1), [(a, pa), (c, pb)])
                _check("concatenate -1", mesh, lambda x, y: torch.concatenate([x, y, x], -1),
                       [(a, pa), (c, pb)])
                _check("stack", mesh, lambda x, y: torch.stack([x, y]), [(a, pa), (c, pb)])
                _check("stack dim2", mesh, lambda x, y: torch.stack((x, y), dim=2), [(a, pa), (c, pb)])
                n += 5
    ws = torch.distributed.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,))
    x = hp.distribute_tensor(a, mesh, [Shard(0)])
    y = hp.distribute_tensor(c, mesh, [Shard(0)])
    out = _no_comm(lambda: torch.cat([x, y], dim=1))
    assert out.placements == (Shard(0),)
    out = _no_comm(lambda: torch.stack([x, y], dim=1))
    assert out.placements == (Shard(0),)
    out = _no_comm(lambda: torch.stack([x, y]))
    assert out.placements == (Shard(1),)
    p = hp.DTensor.from_local(a.clone(), mesh, [Partial()])
    out = _no_comm(lambda: torch.cat([p, p], 0))
    assert out.placements == (Partial(),)
    return n


def _split_body():
    x = _randn(7, 6, 5)
    cases = [
        ("split", x, lambda t: t.split(2)),
        ("torch.split dim1", x, lambda t: torch.split(t, 4, dim=1)),
        ("split sections", x, lambda t: t.split([1, 2, 2], -1)),
        ("split_with_sizes", x, lambda t: t.split_with_sizes([3, 4])),
        ("chunk", x, lambda t: t.chunk(3, 1)),
        ("torch.chunk", x, lambda t: torch.chunk(t, 2)),
        ("unbind", x, lambda t: t.unbind(2)),
        ("torch.unbind", x, lambda t: torch.unbind(t)),
        ("tensor_split", x, lambda t: torch.tensor_split(t, (1, 4), dim=1)),
    ]
    n = _sweep(cases)
    ws = torch.distributed.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,))
    d = hp.distribute_tensor(x, mesh, [Shard(0)])
    outs = _no_comm(lambda: d.chunk(2, dim=1))
    assert all(o.placements == (Shard(0),) for o in outs)
    outs = _no_comm(lambda: d.unbind(1))
    assert len(outs) == 6 and all(o.placements == (Shard(0),) for o in outs)
    return n


def _getitem_body():
    x = _randn(7, 6, 5)
    cases = [
        ("int", x, lambda t: t[1]),
        ("neg int", x, lambda t: t[-2]),
        ("slice", x, lambda t: t[1:5]),
        ("slice step", x, lambda t: t[::2]),
        ("neg step-free slice", x, lambda t: t[-3:]),
        ("full slice + int", x, lambda t: t[:, 2]),
        ("ellipsis int", x, lambda t: t[..., 3]),
        ("ellipsis slice", x, lambda t: t[..., 1:4]),
        ("none", x, lambda t: t[None]),
        ("none mid", x, lambda t: t[:, None, 2:]),
        ("mixed", x, lambda t: t[2, ..., None, ::3]),
        ("tuple ints", x, lambda t: t[1, 2]),
        ("all ints", x, lambda t: t[1, 2, 3]),
        ("full slices", x, lambda t: t[:, :, 0:5]),
        ("list index", x, lambda t: t[[0, 2, 2]]),
    ]
    n = _sweep(cases)
    idx = torch.tensor([4, 0, 2, 2])
    mask = x[:, 0, 0] > 0
    for mesh in _meshes():
        rep = [Replicate()] * mesh.ndim
        di = hp.distribute_tensor(idx, mesh, rep)
        dm = hp.distribute_tensor(mask, mesh, rep)
        for pl in _placements(mesh, 3):
            _check("tensor index", mesh, lambda t: t[di if isinstance(t, hp.DTensor) else idx], [(x, pl)])
            _check("tensor index dim1", mesh, lambda t: t[:, di if isinstance(t, hp.DTensor) else idx],
                   [(x, pl)])
            _check("bool mask", mesh, lambda t: t[dm if isinstance(t, hp.DTensor) else mask], [(x, pl)])
            n += 3
    ws = torch.distributed.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,))
    d = hp.distribute_tensor(x, mesh, [Shard(0)])
    y = _no_comm(lambda: d[:, 2, None, 1:3])
    assert y.placements == (Shard(0),)
    y = _no_comm(lambda: d[..., 1])
    assert y.placements == (Shard(0),)
    y = d[1:3]
    assert y.placements == (Replicate(),)
    return n


def _setitem_body():
    n = 0
    x = _randn(7, 6, 5)
    v = _randn(6, 1, seed=5)
    for mesh in _meshes():
        for pl in _placements(mesh, 3, partial=False):
            pl_ok = [Replicate() if isinstance(p, Shard) and p.dim == 1 else p for p in pl]

            def f_scalar(t):
                t = t * 1.0
                t[:, 2] = 3.5
                return t

            def f_tensor(t, val):
                t = t * 1.0
                t[:, 1:4, ...] = val
                return t

            _check("setitem scalar", mesh, f_scalar, [(x, pl_ok)])
            for pv in _placements(mesh, 2, partial=False):
                _check("setitem tensor", mesh, f_tensor, [(x, pl_ok), (v[:3], pv)])
                n += 1
            n += 1
    return n


def _dimwise_body():
    x = _randn(7, 6, 5)
    m = _randn(5, 7, seed=1)
    cases = [
        ("narrow", x, lambda t: t.narrow(1, 1, 4)),
        ("torch.narrow", x, lambda t: torch.narrow(t, 0, 2, 3)),
        ("select", x, lambda t: t.select(0, 3)),
        ("torch.select -1", x, lambda t: torch.select(t, -1, 1)),
        ("tril", m, lambda t: t.tril()),
        ("triu 1", x, lambda t: torch.triu(t, 1)),
        ("tril -1", x, lambda t: t.tril(diagonal=-1)),
        ("flip", x, lambda t: t.flip(0)),
        ("flip dims", x, lambda t: torch.flip(t, (0, 2))),
        ("flip varargs", x, lambda t: t.flip(1, 2)),
        ("fliplr", m, lambda t: t.fliplr()),
        ("flipud", m, lambda t: torch.flipud(t)),
        ("roll", x, lambda t: t.roll(2, 1)),
        ("roll dims", x, lambda t: torch.roll(t, (1, -2), (0, 2))),
        ("roll flat", x, lambda t: torch.roll(t, 3)),
    ]
    n = _sweep(cases)
    idx = torch.tensor([4, 0, 2, 2, 1])
    gidx = torch.randint(0, 7, (7, 6, 5), generator=torch.Generator().manual_seed(3))
    gidx2 = torch.randint(0, 5, (7, 6, 3), generator=torch.Generator().manual_seed(4))
    for mesh in _meshes():
        rep = [Replicate()] * mesh.ndim
        di = hp.distribute_tensor(idx, mesh, rep)
        for pl in _placements(mesh, 3):
            for dim in (0, 2):
                _check("index_select", mesh,
                       lambda t: t.index_select(dim, di if isinstance(t, hp.DTensor) else idx), [(x, pl)])
                n += 1
            for pi in _placements(mesh, 3, partial=False):
                _check("gather dim0", mesh, lambda t, i: torch.gather(t, 0, i), [(x, pl), (gidx, pi)])
                _check("gather dim2 smaller", mesh, lambda t, i: t.gather(2, i), [(x, pl), (gidx2, pi)])
                n += 2
    ws = torch.distributed.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,))
    d = hp.distribute_tensor(x, mesh, [Shard(0)])
    assert _no_comm(lambda: d.narrow(1, 0, 2)).placements == (Shard(0),)
    assert _no_comm(lambda: d.select(2, 0)).placements == (Shard(0),)
    assert _no_comm(lambda: d.flip(1, 2).tril().roll(1, 2)).placements == (Shard(0),)
    g = hp.distribute_tensor(gidx, mesh, [Shard(0)])
    assert torch.gather(d.redistribute(mesh, [Replicate()]), 0, g).placements == (Shard(0),)
    return n


def _factory_body():
    x = _randn(7, 6, 5)
    n = 0
    for mesh in _meshes():
        for pl in _placements(mesh, 3):
            d = _make(x, mesh, pl, False)
            no_partial = tuple(Replicate() if isinstance(p, Partial) else p for p in d.placements)
            for f, ref, keep in [(torch.zeros_like, torch.zeros(7, 6, 5), True),
                                 (torch.empty_like, None, True),
                                 (torch.ones_like, torch.ones(7, 6, 5), False),
                                 (lambda t: torch.full_like(t, 2.5), torch.full((7, 6, 5), 2.5), False),
                                 (lambda t: t.new_zeros(3, 4), torch.zeros(3, 4), None),
                                 (lambda t: t.new_ones((2,)), torch.ones(2), None),
                                 (lambda t: t.new_full((2, 3), 7.0), torch.full((2, 3), 7.0), None),
                                 (lambda t: t.new_empty((4, 1)), None, None),
                                 (lambda t: t.new_tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), None)]:
                out = f(d)
                assert isinstance(out, hp.DTensor)
                if keep is None:
                    assert out.placements == tuple([Replicate()] * mesh.ndim)
                else:
                    assert out.placements == (d.placements if keep else no_partial), (out.placements, pl)
                if ref is not None:
                    torch.testing.assert_close(out.full_tensor(), ref.to(out.dtype))
                else:
                    assert out.shape == out.full_tensor().shape
                n += 1
            z = torch.zeros_like(d, dtype=torch.float32, requires_grad=True)
            assert z.dtype == torch.float32 and z.requires_grad
    # random *_like: the same values for every layout
    vals = []
    for mesh in _meshes():
        for pl in _placements(mesh, 3):
            if all(isinstance(q, Replicate) for q in pl):
                continue  # whole tensors: torch's own draws (tests/dtensor/test_random_parity.py)
            d = _make(x, mesh, pl, False)
            hp.manual_seed(7)
            r = torch.rand_like(d)
            rn = torch.randn_like(d, dtype=torch.float32)
            assert r.placements == tuple(Replicate() if isinstance(p, Partial) else p for p in d.placements)
            assert rn.dtype == torch.float32
            vals.append((r.full_tensor(), rn.full_tensor()))
            n += 2
    for r, rn in vals[1:]:
        torch.testing.assert_close(r, vals[0][0], rtol=0, atol=0)
        torch.testing.assert_close(rn, vals[0][1], rtol=0, atol=0)
    assert not torch.equal(vals[0][0], vals[0][1].double())
    return n


# ----------------------------------------------------------------------------- tests
def _both(dist, body):
    assert dist.run(2, body)[0] > 0
    assert dist.run(4, body)[0] > 0


def test_cat_stack(dist):
    _both(dist, _join_body)


def test_split_family(dist):
    _both(dist, _split_body)


def test_getitem(dist):
    _both(dist, _getitem_body)


def test_setitem(dist):
    _both(dist, _setitem_body)


def test_dimwise_ops(dist):
    _both(dist, _dimwise_body)


def test_factories(dist):
    _both(dist, _factory_body)
