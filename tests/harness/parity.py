"""Shared parity helpers for the op tests (run on every rank).

``check`` compares values and gradients of a function on DTensors with the same
function on full tensors in one process; ``sweep`` runs it over a sweep of
placements (Shard / Replicate / Partial) on every mesh of the current world.
"""
import torch

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard

# ----------------------------------------------------------------------------- helpers (run on every rank)
DT = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def _meshes():
    ws = torch.distributed.get_world_size()
    meshes = [hp.init_device_mesh("cpu", (ws,))]
    if ws == 4:
        meshes.append(hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    return meshes


def _placements(mesh, nd, partial=True):
    """A sweep of placements for an ``nd``-d tensor on ``mesh``."""
    if mesh.ndim == 1:
        out = [[Shard(i)] for i in range(nd)] + [[Replicate()]]
        return out + ([[Partial()]] if partial else [])
    out = [[Replicate(), Shard(nd - 1)]] if nd else [[Replicate(), Replicate()]]
    if nd >= 1:
        out += [[Shard(0), Shard(0)], [Shard(nd - 1), Shard(0)]]
    if nd >= 2:
        out += [[Shard(0), Shard(1)], [Shard(1), Shard(0)]]
    if partial:
        out += [[Partial(), Shard(0)] if nd else [Partial(), Replicate()], [Replicate(), Partial()]]
    return out


def _make(full, mesh, placements, requires_grad):
    """DTensor holding ``full`` laid out as ``placements`` (Partial pieces sum to ``full``)."""
    if not any(isinstance(p, Partial) for p in placements):
        d = hp.distribute_tensor(full.detach(), mesh, placements)
        return d.requires_grad_() if requires_grad else d
    base = [Replicate() if isinstance(p, Partial) else p for p in placements]
    local = hp.distribute_tensor(full.detach(), mesh, base).to_local().detach().clone()
    coord = mesh.get_coordinate()
    for d, p in enumerate(placements):
        if isinstance(p, Partial):
            k = mesh.size(d)
            local = local * ((coord[d] + 1) * 2.0 / (k * (k + 1)))
    d = hp.DTensor.from_local(local, mesh, placements, shape=tuple(full.shape), stride=full.stride())
    return d.requires_grad_() if requires_grad else d


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _check(label, mesh, f, inputs, check_out=None, tol=TOL, grad=True, warm=True):
    """``inputs``: (full tensor, placements or None for a plain tensor[, requires_grad]).

    Values of ``f`` on DTensors (a tensor or a sequence of tensors) and the gradients of every
    floating input must equal the single-process computation on the full tensors. ``warm``: call
    ``f`` once on copies first, so that the checked call is a dispatch-cache hit (the fast path
    where the op allows it); off for functions that draw random numbers.
    """
    inputs = [(spec[0], spec[1], (spec[2] if len(spec) > 2 else spec[0].is_floating_point()) and grad)
              for spec in inputs]
    refs = [t.detach().clone().requires_grad_(rg) for t, _, rg in inputs]
    ref = _as_list(f(*refs))
    ws = [torch.randn(r.shape, generator=torch.Generator().manual_seed(1234 + i), dtype=DT)
          for i, r in enumerate(ref)]
    if any(r.requires_grad for r in refs):
        sum((r * w).sum() for r, w in zip(ref, ws) if r.requires_grad).backward()
    if warm:  # a first call on copies fills the dispatch caches: the checked call below takes the fast path
        f(*[_make(t, mesh, pl, rg) if pl is not None else t.clone() for t, pl, rg in inputs])
    dts = [_make(t, mesh, pl, rg) if pl is not None else t for t, pl, rg in inputs]
    out = f(*dts)
    outs = _as_list(out)
    assert len(outs) == len(ref), label
    ctx = f"{label} [{mesh.shape} {[spec[1] for spec in inputs]}]"
    for o in outs:
        assert isinstance(o, hp.DTensor), ctx
    if check_out is not None:
        check_out(out)
    fulls = [o.full_tensor() for o in outs]
    for i, (fo, r) in enumerate(zip(fulls, ref)):
        assert tuple(outs[i].shape) == tuple(r.shape), (ctx, outs[i].shape, r.shape)
        torch.testing.assert_close(fo, r.detach(), msg=lambda m: f"{ctx} value {i}\n{m}", **tol)
    if any(r.requires_grad for r in refs):
        sum((fo * w).sum() for fo, w, r in zip(fulls, ws, ref) if r.requires_grad).backward()
    for i, (r, d) in enumerate(zip(refs, dts)):
        if not r.requires_grad or not isinstance(d, hp.DTensor):
            continue
        assert d.grad is not None, f"{ctx}: input {i} got no gradient"
        torch.testing.assert_close(d.grad.full_tensor(), r.grad, msg=lambda m, i=i: f"{ctx} grad {i}\n{m}", **tol)
    return out


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _placed(*pl):
    def chk(out):
        assert tuple(out.placements) == tuple(pl), (out.placements, pl)
    return chk


def _no_comm(f, *args):
    with hp.CommDebugMode() as comm:
        out = f(*args)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    return out


def _outputs(out):
    return out if isinstance(out, (list, tuple)) else [out]


def local_rule(f, placements, strict=True):
    """``f`` on DTensors runs with no collective (under strict layouts) and every output has ``placements``.

    Plain-tensor calls (the one-process reference) run ``f`` unchanged.
    """
    def g(*args):
        if not any(isinstance(a, hp.DTensor) for a in args):
            return f(*args)
        with hp.strict_layouts(strict), hp.CommDebugMode() as comm:
            out = f(*args)
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        for o in _outputs(out):
            assert tuple(o.placements) == tuple(placements), (o.placements, placements)
        return out
    return g


def check_local(label, mesh, f, inputs, placements, tol=None, strict=True):
    """Parity of ``f`` with one process, with the no-collective and output-placement checks of ``local_rule``."""
    _check(label, mesh, local_rule(f, placements, strict), inputs, tol=tol or TOL)


def check_redistributes(label, mesh, f, inputs, placements, match, tol=None):
    """A layout a rule must still gather: ``StrictLayoutError`` under strict layouts, one process's results
    (and output ``placements``) without."""
    import pytest
    dts = [hp.distribute_tensor(t, mesh, pl) for t, pl in inputs]
    with pytest.raises(hp.StrictLayoutError, match=match):
        with hp.strict_layouts():
            f(*dts)

    def checked(*args):
        out = f(*args)
        if any(isinstance(a, hp.DTensor) for a in args):
            for o in _outputs(out):
                if isinstance(o, hp.DTensor):
                    assert tuple(o.placements) == tuple(placements), (label, o.placements)
        return out
    _check(label, mesh, checked, inputs, tol=tol or TOL)


def _sweep(cases, partial=True):
    """cases: (label, full tensor, fn). Every placement of the sweep, every mesh. Returns the count."""
    n = 0
    for mesh in _meshes():
        for label, x, f in cases:
            for pl in _placements(mesh, x.dim(), partial):
                _check(label, mesh, f, [(x, pl)])
                n += 1
    return n


def seeded_mlp():
    """Linear(8, 16) - GELU - Linear(16, 8), the same weights on every call (seed 0): a reference
    model and the one to parallelize (``"0"`` column-wise, ``"2"`` row-wise)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
