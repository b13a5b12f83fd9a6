"""NN ops (softmax, norms, embedding, dropout, losses, attention, scans) on DTensors.

Every case compares values and gradients (inputs and weights) with the
single-process computation on full tensors, over sweeps of placements on 2 and 4
ranks and a (2, 2) mesh, with uneven sizes (3, 5, 7).
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from tests.harness.parity import _make, _meshes, _randn

DT = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


# ----------------------------------------------------------------------------- helpers (run on every rank)
def _placements(mesh, nd, partial=True):
    """A sweep of placements for an ``nd``-d tensor on ``mesh``."""
    if mesh.ndim == 1:
        out = [[Shard(i)] for i in range(nd)] + [[Replicate()]]
        return out + ([[Partial()]] if partial else [])
    out = [[Replicate(), Replicate()]]
    if nd >= 1:
        out += [[Shard(0), Shard(0)], [Replicate(), Shard(nd - 1)], [Shard(nd - 1), Shard(0)]]
    if nd >= 2:
        out += [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(nd - 1), Shard(nd - 2)]]
    if partial:
        out += [[Partial(), Shard(0)] if nd else [Partial(), Replicate()], [Replicate(), Partial()]]
    uniq = []
    for p in out:
        if p not in uniq:
            uniq.append(p)
    return uniq




def _check(label, mesh, f, inputs, check_out=None, tol=TOL):
    """``inputs``: (full tensor, placements or None for a plain tensor[, requires_grad]).

    Values of ``f`` on DTensors and the gradients of every floating input must
    equal the single-process computation on the full tensors.
    """
    inputs = [(spec[0], spec[1], spec[2] if len(spec) > 2 else spec[0].is_floating_point()) for spec in inputs]
    refs = [t.detach().clone().requires_grad_(rg) for t, _, rg in inputs]
    ref = f(*refs)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1234), dtype=ref.dtype)
    (ref * w).sum().backward()
    dts = [_make(t, mesh, pl, rg) if pl is not None else t for t, pl, rg in inputs]
    out = f(*dts)
    assert isinstance(out, hp.DTensor), label
    if check_out is not None:
        check_out(out)
    full = out.full_tensor()
    msg = lambda m: f"{label} [{mesh.shape} {[spec[1] for spec in inputs]}] value\n{m}"  # noqa: E731
    torch.testing.assert_close(full, ref.detach(), msg=msg, **tol)
    full.mul(w).sum().backward()
    for i, (r, d) in enumerate(zip(refs, dts)):
        if not r.requires_grad or not isinstance(d, hp.DTensor):
            continue
        assert d.grad is not None, f"{label}: input {i} got no gradient"
        msg = lambda m, i=i: f"{label} [{mesh.shape} {[spec[1] for spec in inputs]}] grad {i}\n{m}"  # noqa: E731
        torch.testing.assert_close(d.grad.full_tensor(), r.grad, msg=msg, **tol)
    return out






# ----------------------------------------------------------------------------- softmax family
def _softmax_body():
    x = _randn(5, 7, 3)
    fns = [
        ("F.softmax dim0", lambda t: F.softmax(t, dim=0)),
        ("F.softmax dim1", lambda t: F.softmax(t, 1)),
        ("torch.softmax -1", lambda t: torch.softmax(t, -1)),
        ("Tensor.softmax", lambda t: t.softmax(dim=2)),
        ("F.log_softmax", lambda t: F.log_softmax(t, dim=1)),
        ("torch.log_softmax", lambda t: torch.log_softmax(t, 0)),
        ("Tensor.log_softmax", lambda t: t.log_softmax(-1)),
        ("F.softmin", lambda t: F.softmin(t, dim=2)),
    ]
    n = 0
    for mesh in _meshes():
        for pl in _placements(mesh, 3):
            for name, f in (fns if mesh.ndim == 1 else fns[1::2]):
                _check(name, mesh, f, [(x, pl)])
                n += 1
    # sharded dims other than the softmax dim stay put, with no communication
    mesh = _meshes()[-1]
    pl = [Shard(0)] * mesh.ndim
    d = _make(x, mesh, pl, False)
    with hp.CommDebugMode() as comm:
        y = F.softmax(d, dim=-1)
    assert y.placements == tuple(pl) and comm.get_comm_counts() == {}, (y.placements, comm.get_comm_counts())
    return n


def test_softmax_family(dist_runner):
    dist_runner.run(2, _softmax_body)
    dist_runner.run(4, _softmax_body)


# ----------------------------------------------------------------------------- norms
def _norm_body():
    x = _randn(3, 7, 5)
    w = _randn(5, seed=1)
    b = _randn(5, seed=2)
    w2 = _randn(7, 5, seed=3)
    n = 0
    for mesh in _meshes():
        rep = [Replicate()] * mesh.ndim
        wpls = [rep, [Shard(0)] + rep[1:]]
        for pl in _placements(mesh, 3):
            for wpl in wpls:
                _check("layer_norm", mesh, lambda t, ww, bb: F.layer_norm(t, (5,), ww, bb, 1e-5),
                       [(x, pl), (w, wpl), (b, rep)])
                _check("rms_norm", mesh, lambda t, ww: F.rms_norm(t, [5], ww, 1e-6), [(x, pl), (w, wpl)])
                n += 2
            _check("layer_norm 2d", mesh, lambda t, ww: F.layer_norm(t, (7, 5), ww), [(x, pl), (w2, rep)])
            _check("layer_norm no affine", mesh, lambda t: F.layer_norm(t, [5]), [(x, pl)])
            _check("rms_norm no weight", mesh, lambda t: F.rms_norm(t, (7, 5)), [(x, pl)])
            _check("torch.layer_norm", mesh, lambda t, ww, bb: torch.layer_norm(t, [5], ww, bb),
                   [(x, pl), (w, rep), (b, rep)])
            n += 4
        # sequence parallel: Shard(1) activations stay Shard(1), no communication in forward
        seq = [Shard(1)] + rep[1:]
        dx = _make(x, mesh, seq, True)
        dw = _make(w, mesh, rep, True)
        db = _make(b, mesh, rep, True)
        with hp.CommDebugMode() as comm:
            y = F.layer_norm(dx, (5,), dw, db)
            z = F.rms_norm(dx, (5,), dw)
        assert comm.get_comm_counts() == {}, comm.get_comm_counts()
        assert y.placements == tuple(seq) and z.placements == tuple(seq), (y.placements, z.placements)
    return n


def test_norms(dist_runner):
    dist_runner.run(2, _norm_body)
    dist_runner.run(4, _norm_body)


# ----------------------------------------------------------------------------- embedding
def _embedding_body():
    V, D = 7, 5
    ids = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(4))
    ids[0, 0], ids[2, 4] = 0, V - 1
    weight = _randn(V, D, seed=5)
    fns = [
        ("F.embedding", lambda i, w: F.embedding(i, w)),
        ("F.embedding pad", lambda i, w: F.embedding(i, w, padding_idx=2)),
        ("F.embedding pad<0", lambda i, w: F.embedding(i, w, -1)),
        ("torch.embedding", lambda i, w: torch.embedding(w, i)),
        ("F.embedding freq", lambda i, w: F.embedding(i, w, scale_grad_by_freq=True)),
    ]
    n = 0
    for mesh in _meshes():
        id_pls = _placements(mesh, 2, partial=False)
        if mesh.ndim == 2:
            id_pls = [id_pls[0], [Shard(0), Shard(0)], [Shard(1), Replicate()], [Replicate(), Shard(1)]]
        w_pls = _placements(mesh, 2, partial=True)
        for ipl, wpl in itertools.product(id_pls, w_pls):
            for name, f in fns:
                if mesh.ndim == 2 and name not in ("F.embedding", "F.embedding pad<0"):
                    continue
                _check(name, mesh, f, [(ids, ipl), (weight, wpl)])
                n += 1
        # key layouts
        rep = [Replicate()] * mesh.ndim
        ids_b = _make(ids, mesh, [Shard(0)] + rep[1:], False)
        if mesh.ndim == 1:
            vocab = _make(weight, mesh, [Shard(0)], True)
            out = F.embedding(_make(ids, mesh, rep, False), vocab)
            assert out.placements == (Partial(),), out.placements
            out = F.embedding(ids_b, _make(weight, mesh, rep, True))
            assert out.placements == (Shard(0),), out.placements
            out = F.embedding(ids_b, _make(weight, mesh, [Shard(1)], True))
            assert out.placements == (Shard(2),), out.placements
        else:
            vocab = _make(weight, mesh, [Replicate(), Shard(0)], True)
            with hp.CommDebugMode() as comm:
                out = F.embedding(ids_b, vocab)
            assert comm.get_comm_counts() == {}, comm.get_comm_counts()
            assert out.placements == (Shard(0), Partial()), out.placements
    # partial ids are rejected
    mesh = _meshes()[0]
    pid = hp.DTensor.from_local(ids, mesh, [Partial()])
    with pytest.raises(ValueError, match="Partial"):
        F.embedding(pid, _make(weight, mesh, [Replicate()], False))
    return n


def test_embedding(dist_runner):
    dist_runner.run(2, _embedding_body)
    dist_runner.run(4, _embedding_body)


# ----------------------------------------------------------------------------- dropout
def _dropout_body(p):
    x = _randn(7, 6, seed=6).float()
    w = torch.randn(7, 6, generator=torch.Generator().manual_seed(7))
    results = []
    for mesh in _meshes():
        for pl in _placements(mesh, 2):
            if all(isinstance(q, Replicate) for q in pl):
                continue  # whole tensors use torch's own dropout (tests/dtensor/test_random_parity.py)
            for kind in ("F", "torch"):
                hp.manual_seed(123)
                d = _make(x, mesh, pl, True)
                y = F.dropout(d, p, training=True) if kind == "F" else torch.dropout(d, p, True)
                assert not any(isinstance(q, Partial) for q in y.placements), y.placements
                full = y.full_tensor()
                keep = full != 0
                torch.testing.assert_close(full, torch.where(keep, x / (1 - p), torch.zeros_like(x)))
                full.mul(w).sum().backward()
                torch.testing.assert_close(d.grad.full_tensor(), keep.float() * w / (1 - p))
                results.append(full)
                # the stream advances: the next call draws a different mask
                y2 = F.dropout(_make(x, mesh, pl, False), p)
                assert not torch.equal(y2.full_tensor() != 0, keep)
    for r in results[1:]:  # same mask for every sharding (values equal up to the rounding of Partial pieces)
        assert torch.equal(r != 0, results[0] != 0)
        torch.testing.assert_close(r, results[0])
    frac = (results[0] == 0).float().mean().item()
    assert abs(frac - p) < 0.25, frac
    # eval mode and p = 0: identity, no random draw; p = 1: zeros
    mesh = _meshes()[-1]
    d = _make(x, mesh, [Shard(0)] * mesh.ndim, False)
    torch.testing.assert_close(F.dropout(d, p, training=False).full_tensor(), x)
    torch.testing.assert_close(F.dropout(d, 0.0).full_tensor(), x)
    torch.testing.assert_close(F.dropout(d, 1.0).full_tensor(), torch.zeros_like(x))
    return results[0].detach().clone()


def test_dropout_layout_independent(dist_runner):
    r2 = dist_runner.run(2, _dropout_body, 0.3)
    r4 = dist_runner.run(4, _dropout_body, 0.3)
    for r in r2 + r4:
        assert torch.equal(r != 0, r2[0] != 0)
        torch.testing.assert_close(r, r2[0])


# ----------------------------------------------------------------------------- losses
def _loss_body():
    n = 0
    g = torch.Generator().manual_seed(8)
    x2 = _randn(7, 5, seed=9)
    t2 = torch.randint(0, 5, (7,), generator=g)
    t2[3] = -100
    t2i = t2.clone()
    t2i[[1, 3, 5]] = 2
    x3 = _randn(3, 4, 5, seed=10)
    t3 = torch.randint(0, 4, (3, 5), generator=g)
    t3[0, 1] = t3[2, 4] = -100
    cw = _randn(5, seed=11).abs() + 0.5
    cw4 = cw[:4].clone()
    probs = torch.softmax(_randn(7, 5, seed=12), -1)
    for mesh in _meshes():
        rep = [Replicate()] * mesh.ndim
        tpl2 = _placements(mesh, 1, partial=False)
        if mesh.ndim == 2:
            tpl2 = [tpl2[0], [Shard(0), Replicate()], [Shard(0), Shard(0)]]
        for red in ("mean", "sum", "none"):
            for xpl in _placements(mesh, 2):
                for tpl in (tpl2 if red == "mean" else tpl2[:2]):
                    _check(f"ce2 {red}", mesh, lambda a, t: F.cross_entropy(a, t, reduction=red), [(x2, xpl), (t2, tpl)])
                    n += 1
                    if red == "mean":
                        _check(f"ce2 ii {red}", mesh, lambda a, t: F.cross_entropy(a, t, ignore_index=2,
                                                                                   reduction=red),
                               [(x2, xpl), (t2i, tpl)])
                        n += 1
                _check(f"ce2 w ls {red}", mesh,
                       lambda a, t, ww: F.cross_entropy(a, t, ww, reduction=red, label_smoothing=0.1),
                       [(x2, xpl), (t2, tpl2[0]), (cw, rep, False)])
                _check(f"ce2 probs {red}", mesh, lambda a, t: F.cross_entropy(a, t, reduction=red),
                       [(x2, xpl), (probs, xpl if not any(isinstance(q, Partial) for q in xpl) else rep)])
                _check(f"nll {red}", mesh, lambda a, t: F.nll_loss(F.log_softmax(a, 1), t, reduction=red),
                       [(x2, xpl), (t2, tpl2[0])])
                n += 3
            for xpl in _placements(mesh, 3):
                tpl = [Shard(q.dim - 1 if q.dim > 0 else 0) if isinstance(q, Shard) and q.dim != 1 else Replicate()
                       for q in xpl]
                _check(f"ce3 {red}", mesh, lambda a, t: F.cross_entropy(a, t, reduction=red), [(x3, xpl), (t3, tpl)])
                _check(f"ce3 w {red}", mesh, lambda a, t, ww: F.cross_entropy(a, t, ww, reduction=red),
                       [(x3, xpl), (t3, rep), (cw4, rep, False)])
                n += 2
        # 1-d logits with a 0-d (plain) target; nll_loss with class weights
        for xpl in _placements(mesh, 1):
            _check("ce 1d", mesh, lambda a: F.cross_entropy(a, torch.tensor(2)), [(x2[0].clone(), xpl)])
            n += 1
        for xpl in _placements(mesh, 2)[:3]:
            _check("nll w", mesh, lambda a, t, ww: F.nll_loss(a, t, ww), [(x2, xpl), (t2, rep), (cw, rep, False)])
            n += 1
        # batch-sharded mean: output Partial(sum), one scalar all_reduce for the count, no gather of logits
        xs = _make(x2, mesh, [Shard(0)] + rep[1:], True)
        ts = _make(t2, mesh, [Shard(0)] + rep[1:], False)
        with hp.CommDebugMode() as comm:
            loss = F.cross_entropy(xs, ts)
        assert loss.placements[0] == Partial(), loss.placements
        assert set(comm.get_comm_counts()) <= {"all_reduce"}, comm.get_comm_counts()
        none = F.cross_entropy(xs, ts, reduction="none")
        assert none.placements == ts.placements, none.placements
    return n


def test_losses(dist_runner):
    dist_runner.run(2, _loss_body)
    dist_runner.run(4, _loss_body)


# ----------------------------------------------------------------------------- attention
def _sdpa_body():
    n = 0
    q = _randn(2, 3, 5, 4, seed=13)
    k = _randn(2, 3, 7, 4, seed=14)
    v = _randn(2, 3, 7, 6, seed=15)
    bmask = torch.rand(5, 7, generator=torch.Generator().manual_seed(16)) > 0.3
    bmask[:, 0] = True
    fmask = _randn(2, 1, 5, 7, seed=17)
    qg = _randn(3, 4, 5, 4, seed=18)
    kg = _randn(3, 2, 7, 4, seed=19)
    vg = _randn(3, 2, 7, 4, seed=20)
    sdpa = F.scaled_dot_product_attention
    for mesh in _meshes():
        rep = [Replicate()] * mesh.ndim
        pls = _placements(mesh, 4)
        for pl in pls:
            _check("sdpa", mesh, lambda a, b, c: sdpa(a, b, c), [(q, pl), (k, pl), (v, pl)])
            _check("sdpa mixed", mesh, lambda a, b, c: sdpa(a, b, c, scale=0.3), [(q, pl), (k, rep), (v, pls[0])])
            _check("sdpa causal", mesh, lambda a, b, c: sdpa(a, b, c, is_causal=True), [(q, pl), (k, pl), (v, pl)])
            _check("sdpa bool mask", mesh, lambda a, b, c, m: sdpa(a, b, c, attn_mask=m),
                   [(q, pl), (k, pl), (v, pl), (bmask, rep)])
            mpl = [q_ if not isinstance(q_, Shard) or q_.dim != 1 else Replicate() for q_ in pl]
            _check("sdpa float mask", mesh, lambda a, b, c, m: sdpa(a, b, c, m), [(q, pl), (k, pl), (v, pl),
                                                                                   (fmask, mpl)])
            _check("sdpa gqa", mesh, lambda a, b, c: sdpa(a, b, c, enable_gqa=True), [(qg, pl), (kg, pl), (vg, pl)])
            n += 6
        # self-attention: the same DTensor as query, key and value
        for pl in pls[:3]:
            _check("sdpa self", mesh, lambda a: sdpa(a, a, a, is_causal=True), [(k, pl)])
            n += 1
        # batch / head shards pass through with no communication
        hpl = [Shard(1)] + rep[1:]
        dq, dk, dv = (_make(t, mesh, hpl, False) for t in (q, k, v))
        with hp.CommDebugMode() as comm:
            o = sdpa(dq, dk, dv)
        assert comm.get_comm_counts() == {} and o.placements == tuple(hpl), (comm.get_comm_counts(), o.placements)
        # dropout_p > 0 runs (the layout-independent attention dropout, tests/dtensor/test_random_parity.py)
        assert sdpa(dq, dk, dv, dropout_p=0.1).placements == tuple(hpl)
    return n


def test_sdpa(dist_runner):
    dist_runner.run(2, _sdpa_body)
    dist_runner.run(4, _sdpa_body)


# ----------------------------------------------------------------------------- scans
def _scan_body():
    x = _randn(5, 7, seed=21)
    fns = [
        ("cumsum0", lambda t: torch.cumsum(t, 0)),
        ("cumsum1", lambda t: t.cumsum(dim=1)),
        ("cumsum dtype", lambda t: torch.cumsum(t, -1, dtype=torch.float64)),
        ("cumprod", lambda t: torch.cumprod(t, 1)),
        ("logcumsumexp", lambda t: torch.logcumsumexp(t, 0)),
    ]
    n = 0
    for mesh in _meshes():
        for pl in _placements(mesh, 2):
            for name, f in fns:
                _check(name, mesh, f, [(x, pl)])
                n += 1
    mesh = _meshes()[0]
    p = _make(x, mesh, [Partial()], False)
    assert torch.cumsum(p, 1).placements == (Partial(),)
    s = _make(x, mesh, [Shard(0)], False)
    assert torch.cumsum(s, 1).placements == (Shard(0),)
    assert torch.cumsum(s, 0).placements == (Replicate(),)
    return n


def test_scans(dist_runner):
    dist_runner.run(2, _scan_body)
    dist_runner.run(4, _scan_body)


# ----------------------------------------------------------------------------- nn.init on DTensor parameters
def _init_fns():
    import math
    init = torch.nn.init
    return {
        "uniform_": lambda t: init.uniform_(t, -0.5, 0.7),
        "normal_": lambda t: init.normal_(t, 0.1, 2.0),
        "constant_": lambda t: init.constant_(t, 0.25),
        "ones_": init.ones_,
        "zeros_": init.zeros_,
        "xavier_uniform_": lambda t: init.xavier_uniform_(t, gain=1.3),
        "xavier_normal_": init.xavier_normal_,
        "kaiming_uniform_": lambda t: init.kaiming_uniform_(t, a=math.sqrt(5)),
        "kaiming_normal_": lambda t: init.kaiming_normal_(t, mode="fan_out", nonlinearity="relu"),
        "trunc_normal_": lambda t: init.trunc_normal_(t, std=0.5, a=-0.6, b=0.8),       # rejection on normal_
        "trunc_normal_tail": lambda t: init.trunc_normal_(t, mean=0.0, std=1.0, a=1.5, b=3.0),  # uniform_ path
        "eye_": init.eye_,
        "orthogonal_": lambda t: init.orthogonal_(t, gain=1.5),
    }


def _init_expect(name, full, shape):
    """Properties of the (layout-independent) result that single-process torch semantics fix."""
    import math
    from hyper_parallel.core.dtensor.random import random_local
    fan_in, fan_out = shape[1], shape[0]
    if name == "uniform_":   # exactly the DTensor RNG stream of a single process, scaled like torch
        hp.manual_seed(11)
        u = random_local("rand", shape, shape, (0, 0), DT)
        torch.testing.assert_close(full, u * 1.2 - 0.5, rtol=1e-12, atol=1e-12)
    elif name == "normal_":
        hp.manual_seed(11)
        z = random_local("randn", shape, shape, (0, 0), DT)
        torch.testing.assert_close(full, z * 2.0 + 0.1, rtol=1e-12, atol=1e-12)
    elif name in ("constant_", "ones_", "zeros_"):
        v = {"constant_": 0.25, "ones_": 1.0, "zeros_": 0.0}[name]
        assert torch.equal(full, torch.full(shape, v, dtype=DT)), name
    elif name in ("xavier_uniform_", "kaiming_uniform_"):
        bound = 1.3 * math.sqrt(6.0 / (fan_in + fan_out)) if name == "xavier_uniform_" else 1 / math.sqrt(fan_in)
        assert full.abs().max() <= bound and full.abs().max() > 0.5 * bound and full.std() > 0.2 * bound, name
    elif name in ("xavier_normal_", "kaiming_normal_"):
        std = math.sqrt(2.0 / (fan_in + fan_out)) if name == "xavier_normal_" else math.sqrt(2.0 / fan_out)
        assert 0.4 * std < full.std() < 2.0 * std, (name, full.std(), std)
    elif name == "trunc_normal_":
        assert full.min() >= -0.6 and full.max() <= 0.8 and full.std() > 0.1, name
    elif name == "trunc_normal_tail":
        assert full.min() >= 1.5 and full.max() <= 3.0, name
    elif name == "eye_":
        assert torch.equal(full, torch.eye(*shape, dtype=DT)), name
    elif name == "orthogonal_":
        q = full / 1.5
        gram = q @ q.T if shape[0] <= shape[1] else q.T @ q
        torch.testing.assert_close(gram, torch.eye(min(shape), dtype=DT), rtol=1e-10, atol=1e-10)


def _init_body():
    import math
    import torch.nn as nn
    n = 0
    for mesh in _meshes():
        rep = [Replicate()] * mesh.ndim
        for shape in ((7, 5), (5, 7)):      # tall and wide (orthogonal_ transposes in place for wide)
            for name, fn in _init_fns().items():
                results = []
                for pl in [rep] + [p for p in _placements(mesh, 2, partial=False) if p != rep]:
                    prm = nn.Parameter(hp.distribute_tensor(torch.full(shape, 9.0, dtype=DT), mesh, pl))
                    hp.manual_seed(11)
                    torch.manual_seed(11)
                    out = fn(prm)
                    assert out is prm or name in ("orthogonal_",), name
                    assert isinstance(prm, nn.Parameter) and prm.requires_grad and prm.is_leaf, name
                    assert tuple(prm.placements) == tuple(pl) and tuple(prm.shape) == shape, (name, prm.placements)
                    results.append((pl, prm.full_tensor()))
                    n += 1
                # replicated: torch's own init (one process after the same torch.manual_seed)
                torch.manual_seed(11)
                plain = torch.full(shape, 9.0, dtype=DT)
                fn(plain)
                assert torch.equal(results[0][1], plain), (name, mesh.shape, (results[0][1] - plain).abs().max())
                ref = results[1][1]
                _init_expect(name, ref, shape)
                for pl, full in results[2:]:   # layout-independent: every sharded placement gives the same tensor
                    assert torch.equal(full, ref), (name, mesh.shape, pl, (full - ref).abs().max())
        # modules: reset_parameters() on DTensor parameters
        for pl in _placements(mesh, 2, partial=False):
            lin = nn.Linear(5, 7, dtype=DT)
            emb = nn.Embedding(9, 6, dtype=DT)
            for mod in (lin, emb):
                for pname, p in list(mod.named_parameters()):
                    ppl = pl if p.dim() == 2 else [Replicate() if isinstance(q, Shard) and q.dim == 1 else q
                                                   for q in pl]
                    setattr(mod, pname, nn.Parameter(hp.distribute_tensor(p.detach(), mesh, ppl)))
            # references: every parameter replicated -> torch's own init (plain module, same torch seed);
            # every parameter sharded -> the layout-independent stream (the same module sharded on dim 0)
            ref_lin, ref_emb = nn.Linear(5, 7, dtype=DT), nn.Embedding(9, 6, dtype=DT)
            for mod, ref in ((lin, ref_lin), (emb, ref_emb)):
                whole = [all(isinstance(q, Replicate) for q in p.placements) for p in mod.parameters()]
                if not any(whole):
                    for pname, p in list(ref.named_parameters()):
                        setattr(ref, pname, nn.Parameter(hp.distribute_tensor(p.detach(), mesh,
                                                                              [Shard(0)] + rep[1:])))
                hp.manual_seed(5)
                torch.manual_seed(5)
                mod.reset_parameters()
                hp.manual_seed(5)
                torch.manual_seed(5)
                ref.reset_parameters()
                for (pname, p), (_, r) in zip(mod.named_parameters(), ref.named_parameters()):
                    assert isinstance(p, hp.DTensor) and p.requires_grad, pname
                    if all(whole) or not any(whole):  # (mixed: each kind from its own generator)
                        rf = r.full_tensor() if isinstance(r, hp.DTensor) else r.detach()
                        assert torch.equal(p.full_tensor(), rf), (type(mod).__name__, pname, pl)
            w, b = lin.weight.full_tensor(), lin.bias.full_tensor()
            assert w.abs().max() <= 1 / math.sqrt(5) and b.abs().max() <= 1 / math.sqrt(5) and w.std() > 0.1
            e = emb.weight.full_tensor()
            assert 0.6 < e.std() < 1.5, e.std()
            # the initialised module still trains: forward + backward on the DTensor parameters
            x = hp.distribute_tensor(_randn(3, 5), mesh, rep)
            lin(x).sum().backward()
            torch.testing.assert_close(lin.bias.grad.full_tensor(), torch.full((7,), 3.0, dtype=DT))
            n += 1
    # dirac_ needs unsharded kernel dims (element writes); sharded ones raise clearly
    mesh = _meshes()[0]
    conv = hp.distribute_tensor(torch.zeros(4, 4, 3, dtype=DT), mesh, [Replicate()])
    torch.nn.init.dirac_(conv)
    ref = torch.zeros(4, 4, 3, dtype=DT)
    torch.nn.init.dirac_(ref)
    assert torch.equal(conv.full_tensor(), ref)
    with pytest.raises(RuntimeError, match="__setitem__.*sharded dims"):
        torch.nn.init.dirac_(hp.distribute_tensor(torch.zeros(4, 4, 3, dtype=DT), mesh, [Shard(0)]))
    # torch.Tensor.dim / size / numel as unbound calls read the global shape
    assert torch.Tensor.dim(conv) == 3 and torch.Tensor.size(conv) == (4, 4, 3) and torch.Tensor.numel(conv) == 48
    assert torch.Tensor.size(conv, 2) == 3
    return n


def test_nn_init(dist_runner):
    assert dist_runner.run(4, _init_body)[0] > 150
