"""Random ops on DTensors (docs/ops.md, "Random numbers").

* Whole tensors (every placement Replicate, or a shard over a mesh dim of size 1): the op is
  torch's own, so the result is bit-identical to one process after the same ``torch.manual_seed``,
  replicas agree, and every rank's generator ends in the one-process state.
* Sharded tensors: the layout-independent DTensor stream, identical for every mesh and placement
  and equal to the documented transform of ``random_local`` computed in one process.
* ``scaled_dot_product_attention(dropout_p > 0)``: the layout-independent attention dropout,
  values and gradients (float64) equal to ``sdpa_dropout_reference`` in one process for every
  sharding of batch, heads and query sequence (with causal, bool and float masks, GQA).
"""
import hashlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from hyper_parallel.core.dtensor.random import random_local, random_rows
from hyper_parallel.dispatch.rules.attention_dropout import sdpa_dropout_reference
from tests.harness.parity import _make, _meshes, _randn

DT = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def _rng_digest():
    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()


def _all_same(obj):
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, obj)
    return all(s == seen[0] for s in seen)


def _whole_placements(mesh):
    """Layouts in which every rank holds the whole tensor."""
    out = [[Replicate()] * mesh.ndim]
    for d in range(mesh.ndim):
        if mesh.size(d) == 1:  # a shard over a mesh dim of size 1 is the whole tensor
            pl = [Replicate()] * mesh.ndim
            pl[d] = Shard(0)
            out.append(pl)
    return out


def _sharded_placements(mesh, nd):
    if mesh.ndim == 1:
        return [[Shard(i)] for i in range(nd)]
    return [[Shard(0), Shard(0)], [Replicate(), Shard(nd - 1)], [Shard(nd - 1), Shard(0)], [Shard(0), Shard(1)]]


def _random_cases():
    x = _randn(5, 7, seed=1)
    probs = torch.rand(5, 7, generator=torch.Generator().manual_seed(2), dtype=DT)
    gen = lambda: torch.Generator().manual_seed(99)  # noqa: E731
    return x, probs, [
        ("multinomial", probs, lambda t: torch.multinomial(t, 3)),
        ("multinomial replacement", probs, lambda t: t.multinomial(20, replacement=True)),
        ("multinomial 1-d", probs[0], lambda t: torch.multinomial(t, 4)),
        ("multinomial generator", probs, lambda t: torch.multinomial(t, 2, generator=gen())),
        ("F.dropout", x, lambda t: F.dropout(t, 0.4)),
        ("torch.dropout", x, lambda t: torch.dropout(t, 0.3, True)),
        ("rand_like", x, torch.rand_like),
        ("randn_like float32", x, lambda t: torch.randn_like(t, dtype=torch.float32)),
        ("randint_like", x, lambda t: torch.randint_like(t, 3, 9)),
        ("bernoulli", probs, torch.bernoulli),
        ("bernoulli p", x, lambda t: torch.bernoulli(t, 0.25)),
        ("bernoulli_", x, lambda t: t.clone().bernoulli_(0.3)),
        ("normal_", x, lambda t: t.clone().normal_(1.0, 2.0)),
        ("normal_ generator", x, lambda t: t.clone().normal_(generator=gen())),
        ("uniform_", x, lambda t: t.clone().uniform_(-2.0, 3.0)),
        ("exponential_", x, lambda t: t.clone().exponential_(2.0)),
        ("geometric_", x, lambda t: t.clone().geometric_(0.3)),
        ("cauchy_", x, lambda t: t.clone().cauchy_(1.0, 0.5)),
        ("log_normal_", x, lambda t: t.clone().log_normal_(0.5, 0.25)),
        ("nn.init.kaiming_uniform_", x, lambda t: torch.nn.init.kaiming_uniform_(t.clone(), a=math.sqrt(5))),
        ("nn.init.normal_", x, lambda t: torch.nn.init.normal_(t.clone(), 0.1, 0.02)),
        ("nn.init.trunc_normal_", x, lambda t: torch.nn.init.trunc_normal_(t.clone(), std=0.5, a=-0.6, b=0.8)),
        ("nn.init.xavier_normal_", x, lambda t: torch.nn.init.xavier_normal_(t.clone())),
    ]


# ----------------------------------------------------------------------------- whole tensors: torch's draws
def _replicated_body():
    _, _, cases = _random_cases()
    n = 0
    for mesh in _meshes():
        for pl in _whole_placements(mesh):
            for name, full, f in cases:
                torch.manual_seed(1234)
                ref = f(full.clone())
                ref_state = _rng_digest()                      # the generator state one process ends in
                ref_after = torch.rand(3)
                torch.manual_seed(1234)
                d = hp.distribute_tensor(full.clone(), mesh, pl)
                out = f(d)
                assert isinstance(out, hp.DTensor), name
                state = _rng_digest()
                after = torch.rand(3)
                loc = out.to_local()
                assert torch.equal(loc, ref), f"{name} {pl}: not torch's draws\n{loc}\n{ref}"
                assert torch.equal(out.full_tensor(), ref), name
                assert torch.equal(after, ref_after) and state == ref_state, f"{name}: generator out of step"
                assert _all_same((loc.tolist(), state)), f"{name}: replicas or generators differ"
                n += 1
    return n


def test_replicated_random_ops_equal_one_process(dist_runner):
    assert dist_runner.run(2, _replicated_body)[0] > 0
    assert dist_runner.run(4, _replicated_body)[0] > 0


def _stream_body():
    """A whole-tensor op takes its place in the DTensor stream; sharded draws stay layout-independent."""
    x = _randn(6, 5, seed=3)
    mesh = _meshes()[0]
    rep, sh = hp.distribute_tensor(x, mesh, [Replicate()]), hp.distribute_tensor(x, mesh, [Shard(0)])
    outs = []
    for first in (rep, sh, hp.distribute_tensor(x, mesh, [Shard(1)])):
        hp.manual_seed(5)
        torch.manual_seed(0)
        torch.rand_like(first)
        F.dropout(first, 0.5)
        outs.append(torch.rand_like(sh).full_tensor())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    hp.manual_seed(5)
    u = random_local("rand", (6, 5), (6, 5), (0, 0), DT)  # key 0; the ops above used keys 0 and 1
    assert not torch.equal(outs[0], u)
    hp.manual_seed(5)
    random_local("rand", (6, 5), (6, 5), (0, 0), DT)
    random_local("rand", (6, 5), (6, 5), (0, 0), DT)
    torch.testing.assert_close(outs[0], random_local("rand", (6, 5), (6, 5), (0, 0), DT), rtol=0, atol=0)
    # sharded inputs: a generator= is refused (the stream is used), replicated ones take it
    with pytest.raises(NotImplementedError, match="generator"):
        sh.clone().exponential_(generator=torch.Generator().manual_seed(1))
    return True


def test_whole_ops_take_a_stream_key(dist_runner):
    dist_runner.run(2, _stream_body)


# ----------------------------------------------------------------------------- shards: the documented stream
def _sharded_body():
    x = _randn(5, 7, seed=4)
    probs = torch.rand(5, 7, generator=torch.Generator().manual_seed(5), dtype=DT)
    shape, z = (5, 7), (0, 0)

    def u():
        return random_local("rand", shape, shape, z, DT)
    cases = [  # name, input, op, one-process value from the stream's first call after hp.manual_seed
        ("bernoulli", probs, torch.bernoulli, lambda: (u() < probs).to(DT)),
        ("bernoulli p", x, lambda t: torch.bernoulli(t, 0.25), lambda: (u() < 0.25).to(DT)),
        ("bernoulli_", x, lambda t: t.clone().bernoulli_(0.3), lambda: (u() < 0.3).to(DT)),
        ("exponential_", x, lambda t: t.clone().exponential_(2.0), lambda: -torch.log1p(-u()) / 2.0),
        ("geometric_", x, lambda t: t.clone().geometric_(0.3),
         lambda: torch.ceil(torch.log1p(-u()) / math.log1p(-0.3)).clamp_min(1)),
        ("cauchy_", x, lambda t: t.clone().cauchy_(1.0, 0.5), lambda: 1.0 + 0.5 * torch.tan(math.pi * (u() - 0.5))),
        ("log_normal_", x, lambda t: t.clone().log_normal_(0.5, 0.25),
         lambda: torch.exp(0.5 + 0.25 * random_local("randn", shape, shape, z, DT))),
        ("randint_like", x, lambda t: torch.randint_like(t, 3, 9), lambda: (3 + torch.floor(u() * 6)).to(DT)),
        ("rand_like", x, torch.rand_like, u),
        ("normal_", x, lambda t: t.clone().normal_(1.0, 2.0),
         lambda: random_local("randn", shape, shape, z, DT) * 2.0 + 1.0),
    ]
    n = 0
    for name, full, f, expect in cases:
        hp.manual_seed(21)
        ref = expect()
        for mesh in _meshes():
            pls = _sharded_placements(mesh, 2) + ([[Partial()] + [Replicate()] * (mesh.ndim - 1)]
                                                 if name in ("bernoulli", "randint_like", "rand_like") else [])
            for pl in pls:
                hp.manual_seed(21)
                out = f(_make(full, mesh, pl, False))
                assert not any(isinstance(p, Partial) for p in out.placements), (name, out.placements)
                torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-13, atol=1e-13,
                                           msg=lambda m: f"{name} {mesh.shape} {pl}: {m}")
                n += 1
    # the draws follow their distributions
    big = hp.distribute_tensor(torch.zeros(400, 50, dtype=DT), _meshes()[0], [Shard(0)])
    assert abs(big.clone().exponential_(2.0).full_tensor().mean().item() - 0.5) < 0.03
    assert abs(torch.bernoulli(big + 0.3).full_tensor().mean().item() - 0.3) < 0.02
    g = big.clone().geometric_(0.25).full_tensor()
    assert g.min() >= 1 and abs(g.mean().item() - 4.0) < 0.15
    r = torch.randint_like(big, 2, 5).full_tensor()
    assert set(r.unique().tolist()) == {2.0, 3.0, 4.0}
    return n


def test_sharded_random_ops_layout_independent(dist_runner):
    assert dist_runner.run(2, _sharded_body)[0] > 0
    assert dist_runner.run(4, _sharded_body)[0] > 0


# ----------------------------------------------------------------------------- attention dropout
def _sdpa_cases():
    q = _randn(3, 4, 6, 5, seed=13)
    k = _randn(3, 4, 7, 5, seed=14)
    v = _randn(3, 4, 7, 3, seed=15)
    bmask = torch.rand(6, 7, generator=torch.Generator().manual_seed(16)) > 0.3
    bmask[:, 0] = True
    fmask = _randn(3, 1, 6, 7, seed=17)
    qg, kg, vg = _randn(3, 4, 6, 5, seed=18), _randn(3, 2, 7, 5, seed=19), _randn(3, 2, 7, 5, seed=20)
    return [
        ("plain", (q, k, v), {}),
        ("scale", (q, k, v), {"scale": 0.3}),
        ("causal", (q, k, v), {"is_causal": True}),
        ("bool mask", (q, k, v, bmask), {}),
        ("float mask", (q, k, v, fmask), {}),
        ("gqa", (qg, kg, vg), {"enable_gqa": True}),
    ]


def _sdpa_layouts(mesh):
    """(query placements, key/value placements): batch, heads, query sequence and their combinations."""
    r = [Replicate()] * mesh.ndim
    if mesh.ndim == 1:
        return [([Shard(0)], [Shard(0)]), ([Shard(1)], [Shard(1)]), ([Shard(2)], r), ([Shard(2)], [Shard(2)]),
                (r, r)]
    return [([Shard(0), Shard(1)], [Shard(0), Shard(1)]), ([Shard(1), Shard(2)], [Shard(1), Replicate()]),
            ([Shard(0), Shard(2)], [Shard(0), Replicate()]), ([Shard(2), Shard(2)], r), (r, r)]


def _sdpa_dropout_body(p):
    n = 0
    sdpa = F.scaled_dot_product_attention
    for name, tensors, kw in _sdpa_cases():
        refs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors[:3]]
        hp.manual_seed(77)
        ref = sdpa_dropout_reference(*refs, *tensors[3:], dropout_p=p, **kw)
        w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
        (ref * w).sum().backward()
        for mesh in _meshes():
            for qpl, kvpl in _sdpa_layouts(mesh):
                if name == "float mask" and any(isinstance(x, Shard) and x.dim == 1 for x in qpl):
                    mpl = [Replicate() if isinstance(x, Shard) and x.dim == 1 else x for x in qpl]
                else:
                    mpl = qpl
                dts = [_make(tensors[0], mesh, qpl, True), _make(tensors[1], mesh, kvpl, True),
                       _make(tensors[2], mesh, kvpl, True)]
                extra = [_make(m, mesh, mpl if m.dim() == 4 else [Replicate()] * mesh.ndim, False)
                         for m in tensors[3:]]
                hp.manual_seed(77)
                out = sdpa(*dts, *extra, dropout_p=p, **kw)
                label = f"{name} p={p} {mesh.shape} q={qpl} kv={kvpl}"
                if qpl != [Replicate()] * mesh.ndim and name != "gqa":  # (2 kv heads over 4 ranks: unsharded)
                    assert out.placements != tuple([Replicate()] * mesh.ndim), label
                torch.testing.assert_close(out.full_tensor(), ref.detach(), **TOL, msg=lambda m: f"{label}: {m}")
                out.full_tensor().mul(w).sum().backward()
                for i, (d, r) in enumerate(zip(dts, refs)):
                    torch.testing.assert_close(d.grad.full_tensor(), r.grad, **TOL,
                                               msg=lambda m, i=i: f"{label} grad {i}: {m}")
                n += 1
    return n


def test_sdpa_dropout_layout_independent(dist_runner):
    assert dist_runner.run(2, _sdpa_dropout_body, 0.3)[0] > 0
    assert dist_runner.run(4, _sdpa_dropout_body, 0.3)[0] > 0


def test_sdpa_dropout_rule_single_process():
    """The documented rule itself: p = 0 is torch's attention; p > 0 drops u >= p entries, scaled by 1/(1-p)."""
    q, k, v = _randn(2, 3, 6, 4, seed=1), _randn(2, 3, 8, 4, seed=2), _randn(2, 3, 8, 5, seed=3)
    mask = torch.rand(6, 8, generator=torch.Generator().manual_seed(4)) > 0.4
    mask[:, 0] = True
    for kw in ({}, {"is_causal": True}, {"attn_mask": mask}, {"scale": 0.7}):
        torch.testing.assert_close(sdpa_dropout_reference(q, k, v, dropout_p=0.0, **kw),
                                   F.scaled_dot_product_attention(q, k, v, **kw), rtol=1e-12, atol=1e-12)
    p = 0.3
    hp.manual_seed(9)
    got = sdpa_dropout_reference(q, k, v, dropout_p=p)
    hp.manual_seed(9)
    u = random_rows("rand", 2 * 3 * 6, 8, [(0, 36)], torch.float32).reshape(2, 3, 6, 8)
    wts = torch.softmax(q @ k.transpose(-2, -1) / 2.0, -1)
    torch.testing.assert_close(got, (wts * (u >= p).to(DT) / (1 - p)) @ v, rtol=1e-12, atol=1e-12)
    assert abs((u < p).float().mean().item() - p) < 0.12
    hp.manual_seed(9)
    assert torch.equal(sdpa_dropout_reference(q, k, v, dropout_p=1.0), torch.zeros(2, 3, 6, 5, dtype=DT))
    with pytest.raises(ValueError, match="dropout_p"):
        sdpa_dropout_reference(q, k, v, dropout_p=1.5)
    # random_rows: any set of row ranges is the same rows of one matrix
    hp.manual_seed(3)
    full = random_rows("rand", 40, 3000, [(0, 40)], torch.float64)
    hp.manual_seed(3)
    part = random_rows("rand", 40, 3000, [(3, 9), (20, 22), (30, 40)], torch.float64)
    assert torch.equal(part, torch.cat([full[3:9], full[20:22], full[30:40]]))
    hp.manual_seed(3)
    assert torch.equal(full, random_local("rand", (40, 3000), (40, 3000), (0, 0), torch.float64))


def _sdpa_dropout_errors():
    mesh = _meshes()[0]
    q = _make(_randn(2, 2, 4, 3, seed=1), mesh, [Shard(0)], False)
    with pytest.raises(ValueError, match="dropout_p must be between 0 and 1, got 1.5"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    # p = 1: all dropped; p = 0: the plain attention (no draw)
    assert F.scaled_dot_product_attention(q, q, q, dropout_p=1.0).full_tensor().abs().sum() == 0
    full = _randn(2, 2, 4, 3, seed=1)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q, dropout_p=0.0).full_tensor(),
                               F.scaled_dot_product_attention(full, full, full), **TOL)
    return True


def test_sdpa_dropout_errors(dist_runner):
    dist_runner.run(2, _sdpa_dropout_errors)
