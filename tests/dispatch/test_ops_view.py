"""View-like ops on DTensors: reshape family, permutations, expand/broadcast, repeat.

Every case compares values and gradients with the single-process computation on
full tensors over sweeps of placements (Shard / Replicate / Partial) on 2 and 4
ranks and a (2, 2) mesh, with uneven sizes (3, 5, 7); key cases also check the
output placements and that no communication happens.
"""
import torch

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard

from tests.harness.parity import DT, _check, _meshes, _no_comm, _placements, _randn, _sweep


# ----------------------------------------------------------------------------- bodies
def _tm(t, tmpl):
    """The DTensor template for DTensor inputs, its full tensor for the reference."""
    return tmpl if isinstance(t, hp.DTensor) else tmpl.full_tensor()


def _reshape_body():
    a = _randn(8, 6)
    b = _randn(7, 5, 3, seed=1)
    c = _randn(7, 1, 5, seed=2)
    d = _randn(6, 4, 2, seed=3)
    e = _randn(12, seed=4)
    cases = [
        ("reshape (8,6)->(2,4,6)", a, lambda t: t.reshape(2, 4, 6)),
        ("torch.reshape -> (48,)", a, lambda t: torch.reshape(t, (48,))),
        ("view(-1, 3)", a, lambda t: t.view(-1, 3)),
        ("reshape (6,8)", a, lambda t: t.reshape(6, 8)),
        ("reshape (3,16)", a, lambda t: t.reshape([3, 16])),
        ("view (8,1,6)", a, lambda t: t.view(8, 1, 6)),
        ("flatten", a, lambda t: t.flatten()),
        ("unflatten", a, lambda t: t.unflatten(0, (2, 4))),
        ("unflatten -1", a, lambda t: t.unflatten(-1, (3, -1))),
        ("ravel", a, lambda t: t.ravel()),
        ("reshape (35,3)", b, lambda t: t.reshape(35, 3)),
        ("reshape (7,15)", b, lambda t: t.reshape(7, 15)),
        ("view(-1)", b, lambda t: t.view(-1)),
        ("torch.flatten(1)", b, lambda t: torch.flatten(t, 1)),
        ("flatten(0,1)", b, lambda t: t.flatten(0, 1)),
        ("reshape (5,7,3)", b, lambda t: t.reshape(5, 7, 3)),
        ("unsqueeze 0", b, lambda t: t.unsqueeze(0)),
        ("unsqueeze 2", b, lambda t: t.unsqueeze(2)),
        ("squeeze()", c, lambda t: t.squeeze()),
        ("squeeze(1)", c, lambda t: t.squeeze(1)),
        ("torch.squeeze dims", c, lambda t: torch.squeeze(t, (0, 1))),
        ("reshape drop 1", c, lambda t: t.reshape(7, 5)),
        ("reshape (3,2,8)", d, lambda t: t.reshape(3, 2, 8)),
        ("reshape (24,2)", d, lambda t: t.reshape(24, 2)),
        ("view (6,3,4)->(3,2,4,2)?", d, lambda t: t.view(3, 2, 4, 2)),
        ("split (12)->(3,4)", e, lambda t: t.view(3, 4)),
        ("split (12)->(6,2)", e, lambda t: t.reshape(6, 2)),
    ]
    n = _sweep(cases)
    # view_as / reshape_as with a DTensor template
    for mesh in _meshes():
        tmpl = hp.distribute_tensor(torch.zeros(2, 4, 6, dtype=DT), mesh, [Replicate()] * mesh.ndim)
        for pl in _placements(mesh, 2):
            _check("view_as", mesh, lambda t: t.view_as(_tm(t, tmpl)), [(a, pl)])
            _check("reshape_as", mesh, lambda t: t.reshape_as(_tm(t, tmpl)), [(a, pl)])
            n += 2
    return n


def _reshape_layout_body():
    """Key placements, with no communication where the shards line up."""
    ws = torch.distributed.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,))
    a = _randn(8, 6)
    x = hp.distribute_tensor(a, mesh, [Shard(0)])
    y = _no_comm(lambda: x.reshape(2, 4, 6) if ws == 2 else x.reshape(4, 2, 6))
    assert y.placements == (Shard(0),), y.placements
    y = _no_comm(lambda: x.view(48))
    assert y.placements == (Shard(0),)
    y = _no_comm(lambda: x.view(48).view(8, 6))
    assert y.placements == (Shard(0),)
    torch.testing.assert_close(y.full_tensor(), a)
    y = _no_comm(lambda: x.unsqueeze(0).unsqueeze(-1))
    assert y.placements == (Shard(1),)
    x1 = hp.distribute_tensor(a, mesh, [Shard(1)])
    if ws == 2:
        y = _no_comm(lambda: x1.reshape(8, 2, 3))
        assert y.placements == (Shard(1),)
    y = _no_comm(lambda: x1.reshape(4, 2, 6))
    assert y.placements == (Shard(2),)
    # merge of an inner sharded dim: gathered first
    y = x1.reshape(48)
    assert y.placements == (Replicate(),)
    # Partial passes through
    p = hp.DTensor.from_local(a.clone(), mesh, [Partial()])
    y = _no_comm(lambda: p.reshape(2, 24).transpose(0, 1).unsqueeze(0).expand(3, 24, 2))
    assert y.placements == (Partial(),)
    torch.testing.assert_close(y.full_tensor(), ws * a.reshape(2, 24).t().unsqueeze(0).expand(3, 24, 2))
    # uneven pieces that still line up: 6 over 4 ranks = 2,2,2,0 -> (3,2): 1,1,1,0 rows
    e = _randn(6, 5)
    xe = hp.distribute_tensor(e, mesh, [Shard(0)])
    if ws == 4:
        y = _no_comm(lambda: xe.reshape(3, 2, 5))
        assert y.placements == (Shard(0),)
    else:  # 3,3 rows -> 2,1 rows of (2,5): gathered
        y = xe.reshape(3, 2, 5)
        assert y.placements == (Replicate(),)
    torch.testing.assert_close(y.full_tensor(), e.reshape(3, 2, 5))
    # uneven merge: 7 rows do not line up -> gathered, exact values
    b = _randn(7, 5)
    xb = hp.distribute_tensor(b, mesh, [Shard(0)])
    y = xb.reshape(35)
    assert y.placements == (Replicate(),)
    torch.testing.assert_close(y.full_tensor(), b.reshape(35))
    # squeeze of a sharded size-1 dim: gathered
    c = _randn(1, 5)
    y = hp.distribute_tensor(c, mesh, [Shard(0)]).squeeze(0)
    assert y.placements == (Replicate(),)
    torch.testing.assert_close(y.full_tensor(), c.squeeze(0))
    if ws == 4:
        m2 = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        a2 = _randn(8, 6, 4)
        x2 = hp.distribute_tensor(a2, m2, [Shard(0), Shard(2)])
        y = _no_comm(lambda: x2.reshape(2, 4, 6, 4))
        assert y.placements == (Shard(0), Shard(3)), y.placements
        y = x2.reshape(2, 4, 24)  # the inner dim of a merge cannot stay sharded
        assert y.placements == (Shard(0), Replicate()), y.placements
        torch.testing.assert_close(y.full_tensor(), a2.reshape(2, 4, 24))
        x3 = hp.distribute_tensor(a2, m2, [Shard(0), Shard(0)])
        y = _no_comm(lambda: x3.flatten())
        assert y.placements == (Shard(0), Shard(0))
        torch.testing.assert_close(y.full_tensor(), a2.flatten())
        # (6,...) over (dp, tp) = 2x2: [2,2,2,0] pieces -> keeps only what lines up
        a3 = _randn(6, 4)
        y = hp.distribute_tensor(a3, m2, [Shard(0), Shard(0)]).reshape(2, 12)
        torch.testing.assert_close(y.full_tensor(), a3.reshape(2, 12))
    return True


def _permute_body():
    a = _randn(7, 5, 3)
    m = _randn(5, 6, seed=1)
    cases = [
        ("transpose", a, lambda t: t.transpose(0, 1)),
        ("torch.transpose", a, lambda t: torch.transpose(t, -1, 0)),
        ("swapaxes", a, lambda t: t.swapaxes(1, 2)),
        ("swapdims", a, lambda t: torch.swapdims(t, 0, 2)),
        ("permute", a, lambda t: t.permute(2, 0, 1)),
        ("torch.permute", a, lambda t: torch.permute(t, (1, 2, 0))),
        ("movedim", a, lambda t: t.movedim(0, -1)),
        ("moveaxis", a, lambda t: torch.moveaxis(t, (0, 1), (2, 0))),
        ("mT", a, lambda t: t.mT),
        ("t", m, lambda t: t.t()),
        ("torch.t", m, lambda t: torch.t(t)),
        ("T", m, lambda t: t.T),
        ("mT 2d", m, lambda t: t.mT),
        ("transpose+reshape", m, lambda t: t.t().reshape(3, 10)),
    ]
    n = _sweep(cases)
    ws = torch.distributed.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,))
    x = hp.distribute_tensor(a, mesh, [Shard(0)])
    y = _no_comm(lambda: x.permute(2, 0, 1))
    assert y.placements == (Shard(1),)
    y = _no_comm(lambda: x.transpose(0, 2).mT)
    assert y.placements == (Shard(1),)
    return n


def _expand_body():
    a = _randn(1, 6)
    b = _randn(5, 1, 3, seed=1)
    c = _randn(4, 6, seed=2)
    cases = [
        ("expand", a, lambda t: t.expand(4, 6)),
        ("expand -1", a, lambda t: t.expand(5, -1)),
        ("expand new dims", a, lambda t: t.expand(3, 7, 6)),
        ("broadcast_to", b, lambda t: torch.broadcast_to(t, (2, 5, 4, 3))),
        ("expand mid", b, lambda t: t.expand(5, 7, 3)),
        ("expand noop", c, lambda t: t.expand(4, 6)),
        ("expand lead", c, lambda t: t.expand(3, 4, 6)),
        ("repeat", c, lambda t: t.repeat(2, 1)),
        ("repeat list", c, lambda t: t.repeat([1, 3])),
        ("repeat new dims", c, lambda t: t.repeat(2, 1, 1)),
        ("repeat both", b, lambda t: t.repeat(1, 2, 2)),
        ("tile", c, lambda t: t.tile((2,))),
        ("torch.tile", b, lambda t: torch.tile(t, (2, 1, 1, 1))),
    ]
    n = _sweep(cases)
    for mesh in _meshes():
        tmpl = hp.distribute_tensor(torch.zeros(3, 5, 4, 3, dtype=DT), mesh, [Replicate()] * mesh.ndim)
        for pl in _placements(mesh, 3):
            _check("expand_as", mesh, lambda t: t.expand_as(_tm(t, tmpl)), [(_randn(5, 1, 3), pl)])
            n += 1
    ws = torch.distributed.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,))
    x = hp.distribute_tensor(c, mesh, [Shard(0)])
    y = _no_comm(lambda: x.unsqueeze(1).expand(4, 5, 6))
    assert y.placements == (Shard(0),)
    y = _no_comm(lambda: x.repeat(1, 2))
    assert y.placements == (Shard(0),)
    y = x.repeat(2, 1)
    assert y.placements == (Replicate(),)
    return n


# ----------------------------------------------------------------------------- tests
def test_reshape_family(dist):
    assert dist.run(2, _reshape_body)[0] > 0
    assert dist.run(4, _reshape_body)[0] > 0


def test_reshape_layouts(dist):
    assert dist.run(2, _reshape_layout_body) == [True] * 2
    assert dist.run(4, _reshape_layout_body) == [True] * 4


def test_permutations(dist):
    assert dist.run(2, _permute_body)[0] > 0
    assert dist.run(4, _permute_body)[0] > 0


def test_expand_repeat(dist):
    assert dist.run(2, _expand_body)[0] > 0
    assert dist.run(4, _expand_body)[0] > 0


def _copy_body():
    """contiguous / clone / detach keep the layout (Partial included), values and grads exact, no communication."""
    x = _randn(5, 6, seed=31)
    cases = [
        ("contiguous", x, lambda t: _no_comm(lambda: t.transpose(0, 1).contiguous()) * 2),
        ("clone", x, lambda t: _no_comm(lambda: t.clone()) * t),
        ("clone_fmt", x, lambda t: torch.clone(t, memory_format=torch.contiguous_format) + 1),
        ("detach", x, lambda t: _no_comm(lambda: t.detach()) * t),      # grad flows through the second t only
    ]
    n = _sweep(cases)
    for mesh in _meshes():
        for pl in _placements(mesh, 2):
            d = hp.distribute_tensor(x, mesh, [Replicate()] * mesh.ndim).requires_grad_()
            d = d.redistribute(mesh, [p if not p.is_partial() else Replicate() for p in pl])
            for op in (lambda t: t.contiguous(), lambda t: t.clone(), lambda t: t.detach()):
                o = op(d)
                assert isinstance(o, hp.DTensor) and o.placements == d.placements and o.shape == d.shape
            det = d.detach()
            assert not det.requires_grad
            if d.to_local().numel():    # (an empty shard has no storage to compare)
                assert det.to_local().data_ptr() == d.to_local().data_ptr()
                assert d.clone().to_local().data_ptr() != d.to_local().data_ptr()
            n += 1
    return n


def test_contiguous_clone_detach(dist):
    assert dist.run(4, _copy_body)[0] > 0
