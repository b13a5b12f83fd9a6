"""Reductions over a sharded dim that return Partial (issue 24, class 5).

* ``max(dim)`` / ``min(dim)`` on HyperParallel meshes: values ``Partial(max/min)`` over the mesh
  dims sharding ``dim``, indices global and ``Replicate`` there, one all_gather per sharding mesh
  dim; values, indices and gradients equal one process, with ties across ranks, NaN, uneven and
  empty shards. On PyTorch meshes both outputs are ``Replicate`` (the dim is gathered), as in
  ``torch.distributed.tensor``.
* ``prod`` -> ``Partial(prod)``, ``all`` / ``any`` -> ``Partial("all")`` / ``Partial("any")``,
  with no communication until read; values (and prod gradients, zeros included) equal one process;
  the logical partials also reduce_scatter.

2 and 4 ranks; (4,), (2,) and (2, 2) meshes; float64.
"""
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from hyper_parallel.core.dtensor.device_mesh import uses_hp_semantics
from hyper_parallel.device_mesh import init_device_mesh as torch_init_device_mesh

from tests.harness.parity import _check, _no_comm, _randn

DT = torch.float64


def _hp_meshes():
    ws = dist.get_world_size()
    out = [hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("hx",))]
    if ws == 4:
        out.append(hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("hdp", "htp")))
    assert all(uses_hp_semantics(m) for m in out)
    return out


def _torch_meshes():
    ws = dist.get_world_size()
    out = [torch_init_device_mesh("cpu", (ws,), mesh_dim_names=("tx",))]
    if ws == 4:
        out.append(torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("tdp", "ttp")))
    assert not any(uses_hp_semantics(m) for m in out)
    return out


def _sharding(mesh, dim, nd):
    """Placements that shard tensor dim ``dim`` (and, on 2-d meshes, the other dim, ``dim`` twice, or
    a pending sum, which is reduced first)."""
    if mesh.ndim == 1:
        return [[Shard(dim)]]
    other = (dim + 1) % nd
    return [[Shard(dim), Replicate()], [Replicate(), Shard(dim)], [Shard(dim), Shard(dim)],
            [Shard(other), Shard(dim)], [Shard(dim), Shard(other)], [Partial(), Shard(dim)]]


def _sharding_mesh_dims(pl, dim):
    return [md for md, p in enumerate(pl) if p == Shard(dim)]


def _inputs():
    ties = torch.randint(0, 3, (7, 5), generator=torch.Generator().manual_seed(5)).to(DT)  # ties across ranks
    nan = _randn(6, 4, seed=6)
    nan[4, 1] = float("nan")
    nan[1, 2] = float("nan")
    nan[3, 2] = float("nan")
    return [("randn", _randn(7, 5, seed=4)), ("ties", ties), ("short", _randn(3, 6, seed=7)),  # 3 rows: empty shard
            ("nan", nan)]


def _max_min_hp_body():
    n = 0
    for mesh in _hp_meshes():
        for label, x in _inputs():
            for dim in (0, 1):
                for pl in _sharding(mesh, dim, x.dim()):
                    md = _sharding_mesh_dims(pl, dim)
                    for op in ("max", "min"):
                        for keepdim in (False, True):
                            def f(t, op=op, dim=dim, keepdim=keepdim):
                                return getattr(torch, op)(t, dim, keepdim=keepdim)

                            def layouts(out, op=op, pl=pl, md=md, dim=dim, keepdim=keepdim):
                                v, i = out
                                assert type(out).__name__ == op and out.values is v and out.indices is i
                                for d, p in enumerate(pl):
                                    if d in md:
                                        assert v.placements[d] == Partial(op), (v.placements, pl)
                                        assert i.placements[d] == Replicate(), (i.placements, pl)
                                    else:
                                        want = Replicate() if p in (Replicate(), Partial()) else \
                                            Shard(p.dim if keepdim or p.dim < dim else p.dim - 1)
                                        assert v.placements[d] == want and i.placements[d] == want, \
                                            (v.placements, i.placements, pl)
                            out = _check(f"{op}(dim={dim}, keepdim={keepdim}) {label}", mesh, f, [(x, pl)],
                                         check_out=layouts, tol=dict(rtol=1e-12, atol=1e-12, equal_nan=True))
                            ref = f(x)
                            assert torch.equal(out.indices.full_tensor(), ref.indices), (label, op, dim, pl)
                            n += 1
        # one all_gather per sharding mesh dim in forward (values stay Partial), none in backward
        x = _randn(7, 5, seed=8).requires_grad_()
        pl = _sharding(mesh, 0, 2)[2 if mesh.ndim == 2 else 0]  # [S(0), S(0)] on (2, 2)
        assert mesh.ndim == 1 or pl == [Shard(0), Shard(0)]
        d = hp.distribute_tensor(x.detach(), mesh, pl).requires_grad_()
        with hp.CommDebugMode() as comm:
            v, i = d.max(0)
        assert comm.get_comm_counts() == {"all_gather": len(_sharding_mesh_dims(pl, 0))}, comm.get_comm_counts()
        with hp.CommDebugMode() as comm:
            v.to_local().sum().backward()
        assert comm.get_total_counts() == 0
        # the local gradient reaches only the winning element: the summed local grads are one process's
        g = d.grad.full_tensor()
        x.max(0).values.sum().backward()
        torch.testing.assert_close(g, x.grad, rtol=0, atol=0)
    return n


def _max_min_nan_grad_body():
    """NaN wins as on one process (values, indices), and its gradient reaches the first NaN only,
    also when the reduced Partial(max) is read by full_tensor (all_reduce backward) and by redistribute."""
    x = _inputs()[3][1]
    w = _randn(4, seed=14)
    for mesh in _hp_meshes():
        for pl in _sharding(mesh, 0, 2):
            for op in ("max", "min"):
                xr = x.clone().requires_grad_()
                ref = getattr(xr, op)(0)
                ref.values.backward(w)
                for read in ("full_tensor", "redistribute"):
                    d = hp.distribute_tensor(x, mesh, pl).requires_grad_()
                    out = getattr(d, op)(0)
                    if read == "full_tensor":
                        vals = out.values.full_tensor()
                    else:
                        vals = out.values.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
                    torch.testing.assert_close(vals, ref.values, equal_nan=True, rtol=0, atol=0)
                    assert torch.equal(out.indices.full_tensor(), ref.indices)
                    assert ref.values.isnan().sum() == 2
                    vals.backward(w)
                    torch.testing.assert_close(d.grad.full_tensor(), xr.grad, rtol=0, atol=0)
    return True


def _max_min_torch_body():
    """PyTorch meshes keep torch.distributed.tensor's layout: the dim is gathered, both outputs Replicate."""
    n = 0
    for mesh in _torch_meshes():
        for label, x in _inputs()[:3]:
            for pl in _sharding(mesh, 0, 2):
                for op in ("max", "min"):
                    def f(t, op=op):
                        return getattr(torch, op)(t, 0)

                    def layouts(out, pl=pl):
                        for d, p in enumerate(pl):
                            want = Shard(p.dim - 1) if p == Shard(1) else Replicate()  # Partial: reduced
                            assert out.values.placements[d] == want and out.indices.placements[d] == want, \
                                (out.values.placements, out.indices.placements, pl)
                    out = _check(f"torch mesh {op}(0) {label}", mesh, f, [(x, pl)], check_out=layouts)
                    assert torch.equal(out.indices.full_tensor(), f(x).indices)
                    n += 1
    return n


def _same_layout_both_meshes_body():
    """An HP mesh and a PyTorch mesh with the same shape, names and ranks: each keeps its own semantics
    (the dispatch cache must not hand one mesh's answer to the other)."""
    x = _randn(7, 5, seed=9)
    ws = dist.get_world_size()
    res = []
    for make in (hp.init_device_mesh, torch_init_device_mesh, hp.init_device_mesh):
        mesh = make("cpu", (ws,), mesh_dim_names=("same",))
        v, i = hp.distribute_tensor(x, mesh, [Shard(0)]).max(0)
        res.append((tuple(v.placements), tuple(i.placements)))
        torch.testing.assert_close(v.full_tensor(), x.max(0).values)
        assert torch.equal(i.full_tensor(), x.max(0).indices)
    assert res[0] == res[2] == ((Partial("max"),), (Replicate(),)), res
    assert res[1] == ((Replicate(),), (Replicate(),)), res
    return True


def _prod_body():
    x = _randn(7, 5, seed=10) * 0.5 + 1.0
    x[2, 3] = 0.0                                   # exact gradients with a zero
    x[5, 1] = 0.0
    x[6, 1] = 0.0                                   # two zeros in one column
    short = _randn(3, 4, seed=11)
    n = 0
    for mesh in _hp_meshes() + _torch_meshes():
        for t in (x, short):
            for dim in (0, 1):
                for pl in _sharding(mesh, dim, 2):
                    md = _sharding_mesh_dims(pl, dim)
                    for keepdim in (False, True):
                        def f(a, dim=dim, keepdim=keepdim):
                            return torch.prod(a, dim, keepdim=keepdim)

                        def layouts(out, md=md):
                            for d in md:
                                assert out.placements[d] == Partial("prod"), out.placements
                        _check(f"prod({dim}, {keepdim})", mesh, f, [(t, pl)], check_out=layouts)
                        n += 1
                def whole(out):
                    assert Partial("prod") in out.placements and \
                        all(p in (Partial("prod"), Replicate()) for p in out.placements), out.placements
                _check("prod()", mesh, lambda a: a.prod(), [(t, _sharding(mesh, 0, 2)[0])], check_out=whole)
                n += 1
        # no communication until read; a Partial(prod) input stays partial through another prod
        d = hp.distribute_tensor(x, mesh, _sharding(mesh, 0, 2)[0])
        p = _no_comm(lambda: d.prod(0))
        assert Partial("prod") in p.placements
        q = _no_comm(lambda: p.prod())
        torch.testing.assert_close(q.full_tensor(), x.prod(0).prod())
        # a sum consumes the Partial(prod) correctly (reduced first)
        torch.testing.assert_close(p.sum().full_tensor(), x.prod(0).sum())
    return n


def _all_any_body():
    g = torch.Generator().manual_seed(12)
    b = torch.rand(7, 5, generator=g) > 0.3
    b[:, 0] = True                                  # a column of all True
    b[:, 4] = False                                 # a column of all False
    f = torch.randint(-1, 2, (7, 5), generator=g).to(DT)   # numbers: truth value = nonzero
    short = torch.rand(3, 4, generator=g) > 0.5
    n = 0
    for mesh in _hp_meshes() + _torch_meshes():
        for t in (b, f, short):
            for name in ("all", "any"):
                for dim in (0, 1, None):
                    for pl in _sharding(mesh, 0 if dim is None else dim, 2):
                        md = _sharding_mesh_dims(pl, 0 if dim is None else dim)
                        for keepdim in ((False, True) if dim is not None else (False,)):
                            def fn(a, name=name, dim=dim, keepdim=keepdim):
                                return getattr(torch, name)(a) if dim is None else \
                                    getattr(torch, name)(a, dim, keepdim=keepdim)
                            dt = hp.distribute_tensor(t, mesh, pl)   # a Partial(sum) of bools: OR of pieces
                            pending = Partial() in pl                 # reduced first: one collective
                            out = fn(dt) if pending else _no_comm(lambda: fn(dt))
                            for d in md:
                                assert out.placements[d] == Partial(name), (name, out.placements, pl)
                            ref = fn(t)
                            full = out.full_tensor()
                            assert full.dtype == ref.dtype and torch.equal(full, ref), (name, dim, pl, full, ref)
                            n += 1
        # logical partials: reduce_scatter to a shard, and stay partial through the same reduction
        d = hp.distribute_tensor(b, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
        a = d.any(0)
        assert a.placements[0] == Partial("any")
        s = a.redistribute(mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
        assert s.placements[0] == Shard(0)
        assert torch.equal(s.full_tensor(), b.any(0))
        assert torch.equal(_no_comm(lambda: d.all(0).all()).full_tensor(), b.all())
        # a sum of a logical partial reduces it first (counting True values, not pieces)
        assert torch.equal(a.sum().full_tensor(), b.any(0).sum())
    return n


def _mixed_partial_sum_body():
    """sum over a sharded dim of an input pending sum on one mesh dim and max on the other."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    x = _randn(6, 4, seed=13)
    coord = mesh.get_coordinate()
    local = hp.distribute_tensor(x, mesh, [Replicate(), Shard(0)]).to_local()
    local = local * (0.25 if coord[0] == 0 else 0.75)     # sum pieces over mesh dim 0
    d = hp.DTensor.from_local(local, mesh, [Partial("sum"), Shard(0)], shape=x.shape, stride=x.stride())
    m = d.amax(0)                                          # Partial(sum) reduced, then Partial(max) over dim 1
    assert m.placements == (Replicate(), Partial("max")), m.placements
    e = hp.DTensor.from_local(torch.ones(3, dtype=DT) * (1 + coord[0]), mesh, [Partial("sum"), Partial("max")],
                              shape=(3,), stride=(1,))
    s = e.sum()
    torch.testing.assert_close(s.full_tensor(), torch.tensor(9.0, dtype=DT))   # (1 + 2) * 3
    return True


def test_max_min_dim_hp_2(dist_runner):
    assert all(n > 0 for n in dist_runner.run(2, _max_min_hp_body))


def test_max_min_dim_hp_4(dist_runner):
    assert all(n > 0 for n in dist_runner.run(4, _max_min_hp_body, timeout=600))


def test_max_min_dim_nan_grad(dist_runner):
    assert all(dist_runner.run(4, _max_min_nan_grad_body))


def test_max_min_dim_torch_mesh(dist_runner):
    assert all(n > 0 for n in dist_runner.run(4, _max_min_torch_body, timeout=300))


def test_same_layout_hp_and_torch_meshes(dist_runner):
    assert all(dist_runner.run(2, _same_layout_both_meshes_body))


def test_prod_partial(dist_runner):
    assert all(n > 0 for n in dist_runner.run(4, _prod_body, timeout=300))


def test_all_any_partial(dist_runner):
    assert all(n > 0 for n in dist_runner.run(4, _all_any_body, timeout=300))


def test_sum_of_mixed_partials(dist_runner):
    assert all(dist_runner.run(4, _mixed_partial_sum_body))
