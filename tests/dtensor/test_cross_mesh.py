"""Cross-mesh redistribution on 8 real gloo ranks: values, gradients, bytes and message counts.

Meshes: (2, 4), (4, 2), (8,) over all ranks; [0, 1, 2, 3] as (4,) or (2, 2); [4, 5, 6, 7] as (4,)
or (2, 2); [4, 5] as (2,) (so ranks 6 and 7 are outside both meshes of the last pair). One
distributed task runs a seeded sample of placement pairs (Partial sources and targets included)
for every mesh pair, on an even and an uneven float64 shape. Each rank checks:

* forward: on the target mesh, ``to_local()`` equals the ``torch.chunk`` piece of the full tensor
  computed here in one process (a ``Partial`` target: the piece on the first rank of the partial
  group, zeros elsewhere); off the target mesh, an empty local tensor;
* backward: the loss ``sum(local * W_piece)`` (every rank on the target mesh; ranks only on the
  source mesh backpropagate through their empty result) gives the source leaf exactly ``W``'s piece
  under the source layout, the single-process gradient of ``sum(y * W)``;
* communication (CommDebugMode): the number of ``send``/``recv`` messages and the bytes sent equal
  the plan, forward and backward; a Partial source adds exactly the reduction's collectives;
* ranks outside both meshes issue nothing.

Then two pipeline stages (ranks 0-3 with a TP matmul, ranks 4-7 on a (2, 2) mesh) train through
one cross-mesh move like one process, and the error messages are checked.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import DeviceMesh, DTensor, Partial, Replicate, Shard
from hyper_parallel.dtensor import cross_mesh_plan as cmp
from hyper_parallel.core.dtensor.dtensor import build_layout

MESHES = {
    "2x4": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "4x2": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "8": list(range(8)),
    "a4": [0, 1, 2, 3],
    "a2x2": [[0, 1], [2, 3]],
    "b4": [4, 5, 6, 7],
    "b2x2": [[4, 5], [6, 7]],
    "b2": [4, 5],
}
PAIRS = [("2x4", "4x2"), ("4x2", "2x4"), ("8", "2x4"), ("2x4", "8"), ("a4", "b4"), ("a2x2", "b2x2"),
         ("a4", "b2x2"), ("b2x2", "a2x2"), ("a2x2", "2x4"), ("4x2", "b4"), ("a4", "b2")]
SHAPES = [(8, 12), (5, 3)]
PER_PAIR = 8  # placement pairs per mesh pair and shape (seeded sample)


def _meshes():
    """Every mesh, created on every rank in the same order (group creation is collective)."""
    return {k: DeviceMesh("cpu", v) for k, v in MESHES.items()}


def _opts(ndim):
    return list(itertools.product([Replicate(), Shard(0), Shard(1), Partial()], repeat=ndim))


def _cases(meshes_ndim):
    rng = random.Random(16)
    out = []
    for a, b in PAIRS:
        pairs = list(itertools.product(_opts(meshes_ndim[a]), _opts(meshes_ndim[b])))
        # always the all-Replicate and first-Shard pairs, then a sample
        for shape in SHAPES:
            picks = [pairs[0], pairs[len(pairs) // 3]] + rng.sample(pairs, PER_PAIR - 2)
            out += [(a, b, pa, pb, shape) for pa, pb in picks]
    return out


def _piece(full, layout, mesh):
    """This rank's torch.chunk piece of ``full`` under ``layout`` (partial ignored), computed directly."""
    coord = mesh.get_coordinate()
    out = full
    for t, dims in enumerate(layout.dim_map):
        for d in dims:
            pieces = torch.chunk(out, layout.mesh_shape[d], dim=t)
            out = pieces[coord[d]] if coord[d] < len(pieces) else out.narrow(t, 0, 0)
    return out


def _partial_weight(layout, mesh):
    """Uneven positive weights summing to 1 over the partial groups: this rank's part of a Partial(sum)."""
    w = 1.0
    coord = mesh.get_coordinate()
    for d, op in enumerate(layout.partial):
        if op is not None:
            k = layout.mesh_shape[d]
            w *= (coord[d] + 1) * 2.0 / (k * (k + 1))
    return w


def _make_source(full, mesh, placements):
    layout = build_layout(mesh, placements, full.dim())
    if mesh.get_coordinate() is None:  # a rank outside the mesh holds an empty local tensor
        leaf = torch.empty(0, dtype=full.dtype, requires_grad=True)
        return DTensor._wrap(leaf, mesh, layout, tuple(full.shape)), leaf, layout
    leaf = (_piece(full, layout, mesh) * _partial_weight(layout, mesh)).clone().requires_grad_(True)
    return DTensor.from_local(leaf, mesh, list(placements), shape=tuple(full.shape), stride=full.stride()), leaf, layout


def _counts(cm):
    c = cm.get_comm_counts()
    return c, cm.get_bytes()


def _expected(p2p, rank, extra_counts=None):
    counts = dict(extra_counts or {})
    nbytes = {}
    if p2p.sends(rank):
        counts["send"] = p2p.sends(rank)
        nbytes["send"] = p2p.bytes_sent(rank)
    if p2p.recvs(rank):
        counts["recv"] = p2p.recvs(rank)
        nbytes["recv"] = 0
    return counts, nbytes


def _run_case(meshes, a, b, pa, pb, shape, failures):
    rank = dist.get_rank()
    ma, mb = meshes[a], meshes[b]
    tag = f"{a}{list(pa)} -> {b}{list(pb)} shape={shape}"
    n = shape[0] * shape[1]
    full = torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 - 3.0
    W = ((torch.arange(n, dtype=torch.float64) * 7 % 11) - 5).reshape(shape)
    x, leaf, src = _make_source(full, ma, pa)
    dst = build_layout(mb, pb, 2)
    plan = cmp.cross_mesh_plan(src, dst, shape, 8)
    in_a, in_b = ma.get_coordinate() is not None, mb.get_coordinate() is not None

    def check(cond, what):
        if not cond:
            failures.append(f"rank {rank} {tag}: {what() if callable(what) else what}")

    try:
        with hp.CommDebugMode() as fwd:
            y = x.redistribute(mb, list(pb))
        loss = None
        if in_b:
            loss = (y.to_local() * _piece(W, dst, mb)).sum()
        elif in_a:
            loss = y.to_local().sum()
        with hp.CommDebugMode() as bwd:
            if loss is not None:
                loss.backward()
    except Exception as e:  # a collective failed: ranks may be out of step, stop here
        raise RuntimeError(f"rank {rank} {tag}: {type(e).__name__}: {e}") from e

    check(y.device_mesh == mb and tuple(y.placements) == tuple(pb) and tuple(y.shape) == shape,
          lambda: f"metadata {y.device_mesh} {y.placements} {tuple(y.shape)}")
    got = y.to_local()
    if in_b:
        want = _piece(full, dst, mb)
        coord = mb.get_coordinate()
        if any(op is not None and coord[d] != 0 for d, op in enumerate(dst.partial)):
            want = torch.zeros_like(want)
        # exact, except after reducing a Partial source (weights like 1/3 + 2/3 round)
        check(got.shape == want.shape and torch.allclose(got.detach(), want, rtol=1e-14, atol=1e-14),
              lambda: f"values differ: got {got.shape} want {want.shape}")
    else:
        check(got.numel() == 0, f"non-member got a local tensor of shape {tuple(got.shape)}")
    if in_a:
        want_g = _piece(W, src, ma)
        check(leaf.grad is not None and torch.allclose(leaf.grad, want_g, rtol=0, atol=1e-12),
              lambda: f"grad differs: {leaf.grad} vs {want_g}")
    if not in_a and not in_b:
        check(fwd.get_total_counts() == 0 and bwd.get_total_counts() == 0,
              lambda: f"outsider communicated: {fwd.get_comm_counts()} {bwd.get_comm_counts()}")
        return
    pre = {}
    if in_a and plan.pre_steps is not None:
        pre = plan.pre_steps.collective_counts()
    want_fwd = _expected(plan.moves, rank, pre)
    check(_counts(fwd)[0] == want_fwd[0], lambda: f"forward counts {_counts(fwd)[0]} != plan {want_fwd[0]}")
    got_b = {k: v for k, v in fwd.get_bytes().items() if k in ("send", "recv")}
    check(got_b == want_fwd[1], lambda: f"forward bytes {got_b} != plan {want_fwd[1]}")
    want_bwd = _expected(plan.backward, rank)
    got_c = {k: v for k, v in bwd.get_comm_counts().items() if k in ("send", "recv")}
    got_b = {k: v for k, v in bwd.get_bytes().items() if k in ("send", "recv")}
    check(got_c == want_bwd[0] and got_b == want_bwd[1],
          lambda: f"backward {got_c} {got_b} != plan {want_bwd}")


def _sweep():
    meshes = _meshes()
    cases = _cases({k: m.ndim for k, m in meshes.items()})
    failures = []
    for case in cases:
        _run_case(meshes, *case, failures)
    return {"n": len(cases), "failures": failures}


def test_cross_mesh_values_grads_and_messages(dist_runner):
    out = dist_runner.run(8, _sweep, timeout=300)
    failures = [f for o in out for f in o["failures"]]
    assert out[0]["n"] == len(PAIRS) * len(SHAPES) * PER_PAIR
    if failures:
        pytest.fail(f"{len(failures)} failures:\n" + "\n".join(failures[:30]), pytrace=False)


def _errors():
    meshes = _meshes()
    full = torch.arange(96, dtype=torch.float32).reshape(8, 12)
    x, _leaf, _src = _make_source(full, meshes["2x4"], [Shard(0), Replicate()])
    gpu = DeviceMesh("cuda", MESHES["4x2"])  # same ranks as a cpu mesh: no new process groups
    msgs = []
    for call in (lambda: x.redistribute(gpu, [Shard(0), Replicate()]),
                 lambda: x.redistribute(meshes["8"], [Shard(0), Shard(1)]),
                 lambda: x.redistribute(meshes["b4"], [Shard(2)]),
                 lambda: x.redistribute(meshes["b4"], build_layout(meshes["a4"], [Shard(0)], 2))):
        try:
            call()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    # a local tensor that does not fit the global shape it claims: raised before any message is
    # posted (only the source ranks call it here, so no receiver waits)
    if dist.get_rank() < 4:
        layout = build_layout(meshes["a4"], [Shard(0)], 2)
        bad = DTensor._wrap(torch.zeros(3, 12), meshes["a4"], layout, (8, 12))
        try:
            bad.redistribute(meshes["b4"], [Shard(0)])
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_cross_mesh_errors(dist_runner):
    for rank, msgs in enumerate(dist_runner.run(8, _errors)):
        dev, nplace, dim = msgs[:3]
        assert dev and "device type 'cpu'" in dev and "'cuda'" in dev, dev
        assert nplace and "has 2 entries but the mesh (8,) has 1 dims" in nplace, nplace
        assert dim and "dim 2 is out of range for a 2-d tensor" in dim, dim
        assert msgs[3] and "over ranks (0, 1, 2, 3), but the target mesh is DeviceMesh('cpu', [4, 5, 6, 7])" in msgs[3]
        if rank < 4:
            assert msgs[4] and "local tensor has shape (3, 12)" in msgs[4] and "gives it (2, 12)" in msgs[4], msgs[4]


def _pipeline():
    """Two pipeline stages: ranks 0-3 (1-d TP mesh) compute ``relu(X @ W1)``, the activation moves to
    ranks 4-7 (a (2, 2) mesh), which compute ``sum((h @ W2) ** 2)``; one backward pass through both
    stages. Values and gradients against the same computation in one process."""
    ma, mb = DeviceMesh("cpu", [0, 1, 2, 3]), DeviceMesh("cpu", [[4, 5], [6, 7]])
    g = torch.Generator().manual_seed(0)
    X, W1, W2 = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((10, 6), (6, 8), (8, 5)))
    w1r, w2r = W1.clone().requires_grad_(True), W2.clone().requires_grad_(True)
    ref = ((X @ w1r).relu() @ w2r).pow(2).sum()
    ref.backward()
    rank = dist.get_rank()
    in_a = rank < 4
    if in_a:
        w1 = hp.distribute_tensor(W1, ma, [Shard(1)], src_data_rank=None).requires_grad_()
        h = (hp.distribute_tensor(X, ma, [Replicate()], src_data_rank=None) @ w1).relu()
        assert h.placements == (Shard(1),)
    else:  # not on the source mesh: an empty shard that requires grad, like the source
        h = DTensor._wrap(torch.empty(0, dtype=torch.float64, requires_grad=True), ma,
                          build_layout(ma, [Shard(1)], 2), (10, 8))
    with hp.CommDebugMode() as comm:
        h2 = h.redistribute(mb, [Shard(0), Replicate()])
    msgs = (comm.get_comm_counts().get("send", 0), comm.get_comm_counts().get("recv", 0))
    out = {"msgs": msgs, "other": {k: v for k, v in comm.get_comm_counts().items() if k not in ("send", "recv")}}
    if in_a:
        h2.to_local().sum().backward()  # receives the gradient of h from stage 2
        torch.testing.assert_close(w1.grad.full_tensor(), w1r.grad, rtol=1e-12, atol=1e-12)
        out["g1"] = True
    else:
        w2 = hp.distribute_tensor(W2, mb, [Replicate(), Shard(1)], src_data_rank=None).requires_grad_()
        loss = (h2 @ w2).pow(2).sum()
        loss.backward()
        torch.testing.assert_close(loss.full_tensor(), ref.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w2.grad.full_tensor(), w2r.grad, rtol=1e-12, atol=1e-12)
        out["g2"] = True
    return out


def test_two_pipeline_stages_train_like_one_process(dist_runner):
    outs = dist_runner.run(8, _pipeline)
    # Shard(1) over 4 -> Shard(0) over 2, replicated over 2: each target rank needs 5 rows x 8 cols
    # from all 4 sources; the 4 sources share the 8 receivers
    assert sum(o["msgs"][0] for o in outs) == sum(o["msgs"][1] for o in outs) == 16
    assert all(o["other"] == {} for o in outs)
    assert all("g1" in o for o in outs[:4]) and all(o.get("g2") for o in outs[4:])
