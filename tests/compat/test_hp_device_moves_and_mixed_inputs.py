"""Issue 24, classes 3, 4 and 6: device/dtype moves of DTensors, placement lists longer than the mesh,
plain tensors mixed with DTensors.

Class 3 is the same on every mesh: ``cpu()``, ``to(device/dtype/other)``, ``type(...)``, ``double()``...
keep the layout and are differentiable (values and gradients against one process, float64). Classes 4
and 6 differ by the mesh's semantics (``uses_hp_semantics``): HyperParallel's meshes
(``hp.init_device_mesh``) follow HyperParallel, PyTorch's (``hyper_parallel.device_mesh.init_device_mesh``)
keep PyTorch's errors; both sides are tested.
"""
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from hyper_parallel.core.dtensor.device_mesh import uses_hp_semantics
from hyper_parallel.core.dtensor.dtensor import _build_layout
from hyper_parallel.device_mesh import init_device_mesh as torch_init_device_mesh

from tests.harness.parity import _check, _make, _meshes, _placements, _randn

F32 = dict(rtol=2e-6, atol=2e-6)   # float32 results (Partial pieces are cast one by one)


def _placed_like(pl):
    def chk(out):
        assert tuple(out.placements) == tuple(pl), (out.placements, pl)
    return chk


# ----------------------------------------------------------------------------- class 3
def _device_moves():
    x = _randn(7, 6)
    xi = (_randn(7, 6, seed=1) * 10)
    n = 0
    meshes = _meshes() + [torch_init_device_mesh("cpu", (dist.get_world_size(),))]
    for mesh in meshes:
        for pl in _placements(mesh, 2):
            keep = _placed_like(pl)
            # device moves and float casts keep the layout (Partial too) and carry gradients back
            _check("cpu", mesh, lambda t: t.cpu(), [(x, pl)], check_out=keep)
            _check("cpu(memory_format)", mesh, lambda t: t.cpu(memory_format=torch.contiguous_format), [(x, pl)],
                   check_out=keep)
            _check("to(device)", mesh, lambda t: t.to("cpu") * 2, [(x, pl)])
            _check("to(torch.device, copy)", mesh, lambda t: t.to(torch.device("cpu"), copy=True), [(x, pl)],
                   check_out=keep)
            _check("to_dense", mesh, lambda t: t.to_dense(), [(x, pl)], check_out=keep)
            _check("to(float32)", mesh, lambda t: t.to(torch.float32), [(x, pl)], check_out=keep, tol=F32)
            _check("to(device, dtype)", mesh, lambda t: t.to("cpu", torch.float32), [(x, pl)], check_out=keep,
                   tol=F32)
            _check("type(dtype)", mesh, lambda t: t.type(torch.float32), [(x, pl)], check_out=keep, tol=F32)
            _check("type(str)", mesh, lambda t: t.type("torch.FloatTensor"), [(x, pl)], check_out=keep, tol=F32)
            _check("float().double()", mesh, lambda t: t.float().double(), [(x, pl)], check_out=keep, tol=F32)
            _check("half", mesh, lambda t: t.half(), [(x, pl)], check_out=keep, tol=dict(rtol=2e-3, atol=2e-3))
            _check("bfloat16", mesh, lambda t: t.bfloat16(), [(x, pl)], check_out=keep,
                   tol=dict(rtol=2e-2, atol=2e-2))
            _check("to(other DTensor)", mesh, lambda t, o: t.to(o), [(x, pl), (x.float(), pl, False)],
                   check_out=keep, tol=F32)
            _check("to(other plain)", mesh, lambda t: t.to(torch.zeros(3, 5, dtype=torch.float32)), [(x, pl)],
                   check_out=keep, tol=F32)
            _check("type_as(plain of another shape)", mesh,
                   lambda t: t.type_as(torch.zeros(5, dtype=torch.float32)), [(x, pl)], check_out=keep, tol=F32)
            # integer / bool casts: exact values (a Partial is reduced before rounding)
            for name, f in [("int", lambda t: t.int()), ("long", lambda t: t.long()), ("bool", lambda t: t.bool()),
                            ("short", lambda t: t.short()), ("type(int64)", lambda t: t.type(torch.int64)),
                            ("type('torch.LongTensor')", lambda t: t.type("torch.LongTensor"))]:
                out = _check(name, mesh, f, [(xi, pl)], grad=False)
                assert not out.placements or all(not isinstance(p, Partial) for p in out.placements)
            n += 22
            d = _make(x, mesh, pl, False)
            assert d.type() == "torch.DoubleTensor" and d.float().type() == "torch.FloatTensor"
            assert d.share_memory_() is d and d.placements == tuple(pl) and d.to_local().is_shared()
            # numpy() / np.asarray(): on PyTorch's meshes the whole tensor's values on every rank (collective,
            # like tolist()); on HyperParallel's the local piece, as its storage-backed DTensor (issue 33)
            a = d.numpy()
            want = d.to_local() if uses_hp_semantics(mesh) else x
            assert a.shape == tuple(want.shape), (a.shape, pl)
            torch.testing.assert_close(torch.from_numpy(a), want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(torch.from_numpy(np.asarray(d)), want, rtol=1e-12, atol=1e-12)
            with pytest.raises(RuntimeError, match="requires grad"):   # the framework's own rule
                _make(x, mesh, pl, True).numpy()
    # cuda(): on a build without CUDA the framework's own error, not a missing sharding rule
    mesh = meshes[0]
    d = hp.distribute_tensor(x, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    if torch.cuda.is_available():  # pragma: no cover - CPU-only CI
        c = d.cuda()
        assert c.device.type == "cuda" and c.placements == d.placements
        torch.testing.assert_close(c.cpu().full_tensor(), x)
    else:
        with pytest.raises(Exception) as ei:
            d.cuda()
        assert "sharding rule" not in str(ei.value) and "CUDA" in str(ei.value), str(ei.value)
    # gradient of a moved/cast DTensor comes back with the original dtype and device
    leaf = hp.distribute_tensor(x, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1)).requires_grad_()
    (leaf.cpu().float() * 3).sum().backward()
    assert leaf.grad.dtype == torch.float64 and leaf.grad.device.type == "cpu"
    torch.testing.assert_close(leaf.grad.full_tensor(), torch.full_like(x, 3.0))
    return n


@pytest.mark.parametrize("ws", [2, 4])
def test_device_and_dtype_moves_keep_layout(dist_runner, ws):
    counts = dist_runner.run(ws, _device_moves)
    assert counts[0] > 0


# ----------------------------------------------------------------------------- class 4
_LONG = [(Shard(0), Replicate(), Shard(1)), (Shard(0), Replicate(), Replicate(), Replicate()),
         (Replicate(), Shard(1), Partial()), (Shard(1), Shard(0), Shard(0), Partial("max"))]


def _entry_points(mesh, x, pl):
    """The four entry points with placements ``pl``: DTensors (and the layout) they build."""
    return {
        "distribute_tensor": hp.distribute_tensor(x, mesh, pl),
        "from_local": hp.DTensor.from_local(
            hp.distribute_tensor(x, mesh, pl[:mesh.ndim]).to_local(), mesh, pl, shape=x.shape, stride=x.stride()),
        "redistribute": hp.distribute_tensor(x, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, pl),
        "_build_layout": _build_layout(mesh, pl, x.dim()),
        "factory": hp.ones((7, 6), mesh, pl),
    }


def _long_placements():
    hmesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tmesh = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert uses_hp_semantics(hmesh) and not uses_hp_semantics(tmesh)
    x = _randn(7, 6)
    for pl in _LONG:
        kept = pl[:2]
        want = hp.distribute_tensor(x, hmesh, kept)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = _entry_points(hmesh, x, pl)
        msgs = [str(m.message) for m in w if "past the mesh's last dim" in str(m.message)]
        # one warning for this list (not one per entry point), naming the ignored entries
        assert len(msgs) == 1, msgs
        assert f"ignored: {tuple(pl[2:])}" in msgs[0], msgs[0]
        for name in ("distribute_tensor", "from_local", "redistribute"):
            d = got[name]
            assert d.placements == tuple(kept) and d.layout == want.layout, (name, pl, d.placements)
            torch.testing.assert_close(d.full_tensor(), x, rtol=0, atol=0)
            torch.testing.assert_close(d.to_local(), want.to_local(), rtol=0, atol=0)
        assert got["_build_layout"] == want.layout
        assert got["factory"].placements == tuple(kept)
        torch.testing.assert_close(got["factory"].full_tensor(), torch.ones(7, 6))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same list again: no second warning
            hp.distribute_tensor(x, hmesh, pl)
        # the differentiable entry points carry gradients as with the mesh-length list
        leaf = x.clone().requires_grad_()
        r = hp.DTensor.from_local(leaf, hmesh, [Replicate(), Replicate(), Shard(0)])
        (r.redistribute(hmesh, pl).full_tensor() * 2).sum().backward()
        torch.testing.assert_close(leaf.grad, torch.full_like(x, 2.0))
        # PyTorch's mesh: the errors stay (after the HyperParallel mesh cached its layout)
        with pytest.raises(ValueError, match=r"`placements` must have the same length as `device_mesh.ndim`"):
            hp.distribute_tensor(x, tmesh, pl)
        if any(not isinstance(p, Replicate) for p in pl[2:]):
            extra = r"has \d entries but the mesh \(2, 2\) has 2 dims; the extra entry placements\[\d\]"
            with pytest.raises(ValueError, match=extra):
                hp.DTensor.from_local(want.to_local(), tmesh, pl)
            with pytest.raises((ValueError, RuntimeError), match=extra + "|redistributing to Partial"):
                hp.distribute_tensor(x, tmesh, [Replicate(), Replicate()]).redistribute(tmesh, pl)
            with pytest.raises(ValueError, match=extra):
                _build_layout(tmesh, pl, 2)
        else:  # extra trailing Replicate() entries: dropped there too (today's rule), without a warning
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert hp.DTensor.from_local(want.to_local(), tmesh, pl).placements == tuple(kept)
                assert _build_layout(tmesh, pl, 2).placements == tuple(kept)
    # a shorter list: padded with Replicate() by every entry point on HyperParallel's mesh
    assert hp.distribute_tensor(x, hmesh, [Shard(1)]).placements == (Shard(1), Replicate())
    with pytest.raises(ValueError, match=r"`placements` must have the same length"):
        hp.distribute_tensor(x, tmesh, [Shard(1)])
    # sliced HyperParallel meshes keep its rule
    sub = hmesh["tp"]
    assert uses_hp_semantics(sub)
    with pytest.warns(UserWarning, match=r"ignored: \(Shard\(dim=1\),\)"):
        s = hp.distribute_tensor(x, sub, [Shard(0), Shard(1)])
    assert s.placements == (Shard(0),)
    torch.testing.assert_close(s.full_tensor(), x)


def test_placements_longer_than_mesh(dist_runner):
    dist_runner.run(4, _long_placements)


# ----------------------------------------------------------------------------- class 6
def _bias_check(mesh, x, b, b2, pl):
    """``x + b`` and ``x @ w + b2`` with plain biases: values and gradients (x and the plain biases) vs one process."""
    rx, rb, rb2 = x.clone().requires_grad_(), b.clone().requires_grad_(), b2.clone().requires_grad_()
    w = _randn(x.shape[1], b2.shape[0], seed=9)
    f = lambda x_, w_, b_, b2_: torch.cat([(x_ + b_).sum(0) * 1.5, ((x_ @ w_) + b2_).pow(2).sum(0)])
    ref = f(rx, w, rb, rb2)
    gw = _randn(*ref.shape, seed=11)
    (ref * gw).sum().backward()
    dx, db, db2 = _make(x, mesh, pl, True), b.clone().requires_grad_(), b2.clone().requires_grad_()
    dw = hp.distribute_tensor(w, mesh, [Replicate()] * mesh.ndim)
    out = f(dx, dw, db, db2)
    assert isinstance(out, hp.DTensor)
    full = out.full_tensor()
    torch.testing.assert_close(full, ref.detach(), rtol=1e-12, atol=1e-12)
    (full * gw).sum().backward()
    torch.testing.assert_close(dx.grad.full_tensor(), rx.grad, rtol=1e-12, atol=1e-12)
    for got, want in ((db, rb), (db2, rb2)):   # the plain biases get the single-process gradient
        assert type(got.grad) is torch.Tensor
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)


def _plain_mixed():
    ws = dist.get_world_size()
    x, b = _randn(8, 6), _randn(6, seed=3)
    hmeshes = _meshes()
    assert all(uses_hp_semantics(m) for m in hmeshes)
    n = 0
    for mesh in hmeshes:
        for pl in _placements(mesh, 2):
            _bias_check(mesh, x, b, b[:5], pl)
            _bias_check(mesh, x, b * -2.0, b[1:] + 1.0, pl)   # a second call (cache hit) with other values
            n += 2
            # plain operand layout: the output is laid out like the DTensor
            d = _make(x, mesh, pl, False)
            out = d * b
            assert isinstance(out, hp.DTensor)
            torch.testing.assert_close(out.full_tensor(), x * b, rtol=1e-12, atol=1e-12)
        # repeat_interleave with a plain repeats tensor (HyperParallel's case), on both dims; values change
        # between calls of the same shape (a cache hit must not reuse the first call's output shape)
        for dim, pl in [(1, [Shard(0)] + [Replicate()] * (mesh.ndim - 1)),
                        (0, [Shard(1)] + [Replicate()] * (mesh.ndim - 1)),
                        (1, [Replicate()] * mesh.ndim)]:
            for seed in (0, 1):
                reps = torch.randint(1, 4, (x.shape[dim],), generator=torch.Generator().manual_seed(seed))
                _check(f"repeat_interleave dim={dim}", mesh, lambda t: torch.repeat_interleave(t, reps, dim=dim),
                       [(x, pl)])
                _check(f"Tensor.repeat_interleave dim={dim}", mesh, lambda t: t.repeat_interleave(reps, dim),
                       [(x, pl)])
                n += 2
    # PyTorch's mesh: a plain tensor mixed with DTensors still raises (PyTorch's rule) ...
    tmesh = torch_init_device_mesh("cpu", (ws,))
    assert not uses_hp_semantics(tmesh)
    td = hp.distribute_tensor(x, tmesh, [Shard(0)])
    reps = torch.ones(6, dtype=torch.long) * 2
    for f in (lambda: td + b, lambda: td * b, lambda: torch.repeat_interleave(td, reps, dim=1)):
        with pytest.raises(RuntimeError, match=r"got a plain tensor of shape \(6,\) mixed with DTensors"):
            f()
    # ... also after the same call was cached on a HyperParallel mesh of the same shape
    hd = hp.distribute_tensor(x, hp.init_device_mesh("cpu", (ws,)), [Shard(0)])
    hd + b
    with pytest.raises(RuntimeError, match="mixed with DTensors"):
        td + b
    with hp.implicit_replication():   # ... unless asked for
        torch.testing.assert_close((td + b).full_tensor(), x + b)
    return n


@pytest.mark.parametrize("ws", [2, 4])
def test_plain_tensors_mixed_with_dtensors(dist_runner, ws):
    assert dist_runner.run(ws, _plain_mixed)[0] > 0
