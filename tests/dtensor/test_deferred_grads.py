"""Deferred gradient reductions: partial sums of replicated parameters, dp averages.

A replicated DTensor parameter applied to sharded activations (a norm weight
under sequence parallelism) has a partial gradient. As in PyTorch, backward
leaves it ``Partial`` with no collective; its first redistribution (optimizer
step, ``clip_grad_norm_``, ``full_tensor``) sums every pending partial gradient
in one flat all_reduce per group. ``replicate`` parameters need a dp average,
done once per backward in one flat all_reduce. Every case compares the
gradients with the same computation on full tensors in one process, and counts
the collectives.
"""
import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from hyper_parallel.core.tensor_parallel import replicate
from hyper_parallel.platform import get_platform

DT = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def _params(mesh, *tensors):
    """Replicated DTensor parameters holding ``tensors`` (the same on every rank)."""
    return [torch.nn.Parameter(hp.distribute_tensor(t.clone(), mesh, [Replicate()] * mesh.ndim)) for t in tensors]


def _ref(*tensors):
    return [t.clone().requires_grad_(True) for t in tensors]


def _loss(x, w1, w2, y=None):
    """Two replicated weights on (sharded) activations; ``y``: a second, ordinary use of ``w1``."""
    out = ((x * w1).tanh() * w2).sum()
    return out if y is None else out + (y * w1).sum()


def _partial_cases():
    ws = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, dtype=DT, generator=g)
    y = torch.randn(3, 5, dtype=DT, generator=g)
    w1, w2 = torch.randn(5, dtype=DT, generator=g), torch.randn(5, dtype=DT, generator=g)
    dx = hp.distribute_tensor(x, mesh, [Shard(0)])
    dy = hp.distribute_tensor(y, mesh, [Replicate()])

    # 1. two parameters with partial grads: backward leaves both Partial with no collective;
    #    the first full_tensor() sums both in one flat all_reduce, the second costs nothing
    p1, p2 = _params(mesh, w1, w2)
    r1, r2 = _ref(w1, w2)
    with hp.CommDebugMode() as comm:
        _loss(dx, p1, p2).backward()
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert p1.grad.placements == (Partial(),) and p2.grad.placements == (Partial(),)
    _loss(x, r1, r2).backward()
    # the local pieces sum to the gradient
    pieces = [torch.empty_like(r1.grad) for _ in range(ws)]
    dist.all_gather(pieces, p1.grad.to_local())
    torch.testing.assert_close(sum(pieces), r1.grad, **TOL)
    g1 = p1.grad
    with hp.CommDebugMode() as comm:
        full1 = p1.grad.full_tensor()
    assert comm.get_comm_counts() == {"all_reduce": 1}, comm.get_comm_counts()
    # both weights in one flat fp64 buffer (bytes sent by a ring all_reduce: 2 (k-1)/k of it)
    assert comm.get_total_bytes() == 2 * (ws - 1) * (2 * 5 * 8) // ws, comm.get_total_bytes()
    with hp.CommDebugMode() as comm:
        full2 = p2.grad.full_tensor()
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    torch.testing.assert_close(full1, r1.grad, **TOL)
    torch.testing.assert_close(full2, r2.grad, **TOL)
    # a view handed out before the sum now says Replicate and holds the sum
    assert g1.placements == (Replicate(),) and p2.grad.placements == (Replicate(),)
    torch.testing.assert_close(g1.to_local(), r1.grad, **TOL)
    assert get_platform().deferred_grads.pending_tasks() == 0

    # 2. accumulation over two backward passes (microbatches) and a mixed use of w1
    #    (partial through x, ordinary through the replicated y): still no collective, still Partial
    p1, p2 = _params(mesh, w1, w2)
    r1, r2 = _ref(w1, w2)
    with hp.CommDebugMode() as comm:
        for scale in (1.0, 0.5):
            _loss(dx * scale, p1, p2, dy).backward()
            _loss(x * scale, r1, r2, y).backward()
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert p1.grad.placements == (Partial(),)
    torch.testing.assert_close(p1.grad.full_tensor(), r1.grad, **TOL)
    torch.testing.assert_close(p2.grad.full_tensor(), r2.grad, **TOL)

    # 2b. pieces, then a backward where w1 has only an ordinary use, then one through
    #     to_local(grad_placements=); then a backward on summed (full) gradients: summed at the end
    #     of that backward, the grads stay Replicate
    p1, p2 = _params(mesh, w1, w2)
    r1, r2 = _ref(w1, w2)
    _loss(dx, p1, p2).backward()
    _loss(x, r1, r2).backward()
    (dy * p1).sum().backward()
    (y * r1).sum().backward()
    assert p1.grad.placements == (Partial(),)
    # then a use through to_local(grad_placements=[Partial()]), which PyTorch sums in that backward:
    # the pieces are summed first (all pending ones), and the grads come out Replicate and right
    lp = p1.to_local(grad_placements=[Partial()])
    (dx.to_local() * lp).sum().backward()
    (x * r1).sum().backward()
    assert p1.grad.placements == (Replicate(),) and p2.grad.placements == (Replicate(),)
    torch.testing.assert_close(p1.grad.full_tensor(), r1.grad, **TOL)
    with hp.CommDebugMode() as comm:
        _loss(dx, p1, p2).backward()
    # both hold summed values now; on full gradients both new parts are summed at the end, in one buffer
    assert comm.get_comm_counts() == {"all_reduce": 1}, comm.get_comm_counts()
    _loss(x, r1, r2).backward()
    assert p1.grad.placements == (Replicate(),) and p2.grad.placements == (Replicate(),)
    torch.testing.assert_close(p1.grad.full_tensor(), r1.grad, **TOL)
    torch.testing.assert_close(p2.grad.full_tensor(), r2.grad, **TOL)
    # zero_grad (set to None) forgets the pieces: the next backward starts Partial again
    p1.grad = p2.grad = None
    _loss(dx, p1, p2).backward()
    assert p1.grad.placements == (Partial(),)
    q1, q2 = _ref(w1, w2)
    _loss(x, q1, q2).backward()
    torch.testing.assert_close(p1.grad.full_tensor(), q1.grad, **TOL)

    # 3. autograd.grad accumulates nothing: the reduction happens immediately and is returned
    p1, p2 = _params(mesh, w1, w2)
    r1, r2 = _ref(w1, w2)
    g1, g2 = torch.autograd.grad(_loss(dx, p1, p2), [p1, p2])
    e1, e2 = torch.autograd.grad(_loss(x, r1, r2), [r1, r2])
    torch.testing.assert_close(g1.full_tensor(), e1, **TOL)
    torch.testing.assert_close(g2.full_tensor(), e2, **TOL)
    assert p1.grad is None and p2.grad is None

    # 4. backward(inputs=[w2]): only w2 is accumulated (and reduced)
    p1, p2 = _params(mesh, w1, w2)
    r1, r2 = _ref(w1, w2)
    _loss(dx, p1, p2).backward(inputs=[p2])
    _loss(x, r1, r2).backward(inputs=[r2])
    assert p1.grad is None
    torch.testing.assert_close(p2.grad.full_tensor(), r2.grad, **TOL)

    # 5. torch.autograd.backward over a non-scalar DTensor output with a DTensor gradient
    p1, p2 = _params(mesh, w1, w2)
    r1, r2 = _ref(w1, w2)
    gy = torch.randn(6, 5, dtype=DT, generator=g)
    torch.autograd.backward([(dx * p1).tanh() * p2], [hp.distribute_tensor(gy, mesh, [Shard(0)])])
    torch.autograd.backward([(x * r1).tanh() * r2], [gy])
    torch.testing.assert_close(p1.grad.full_tensor(), r1.grad, **TOL)
    torch.testing.assert_close(p2.grad.full_tensor(), r2.grad, **TOL)
    # 6. an optimizer step sums the pending gradients in one all_reduce, then updates as on one process
    p1, p2 = _params(mesh, w1, w2)
    r1, r2 = _ref(w1, w2)
    opt, ropt = torch.optim.SGD([p1, p2], lr=0.1), torch.optim.SGD([r1, r2], lr=0.1)
    _loss(dx, p1, p2).backward()
    _loss(x, r1, r2).backward()
    with hp.CommDebugMode() as comm:
        opt.step()
    assert comm.get_comm_counts() == {"all_reduce": 1}, comm.get_comm_counts()
    ropt.step()
    torch.testing.assert_close(p1.full_tensor(), r1.detach(), **TOL)
    torch.testing.assert_close(p2.full_tensor(), r2.detach(), **TOL)
    # Adam's for-loop, foreach and fused implementations: one all_reduce per step, updates as on one process
    for kw in (dict(foreach=False), dict(foreach=True), dict(fused=True)):
        q1, q2 = _params(mesh, w1, w2)
        s1, s2 = _ref(w1, w2)
        qopt, sopt = torch.optim.Adam([q1, q2], lr=0.1, **kw), torch.optim.Adam([s1, s2], lr=0.1, foreach=False)
        for _ in range(2):
            _loss(dx, q1, q2).backward()
            _loss(x, s1, s2).backward()
            assert q1.grad.placements == (Partial(),)
            with hp.CommDebugMode() as comm:
                qopt.step()
            assert comm.get_comm_counts() == {"all_reduce": 1}, (kw, comm.get_comm_counts())
            sopt.step()
            qopt.zero_grad(), sopt.zero_grad()
        torch.testing.assert_close(q1.full_tensor(), s1.detach(), rtol=1e-10, atol=1e-12, msg=str(kw))
        torch.testing.assert_close(q2.full_tensor(), s2.detach(), rtol=1e-10, atol=1e-12, msg=str(kw))
    # HyperParallel's pattern: the optimizer on local tensors under SkipDTensorDispatch (entering sums)
    opt.zero_grad(), ropt.zero_grad()
    _loss(dx, p1, p2).backward()
    _loss(x, r1, r2).backward()
    with hp.CommDebugMode() as comm:
        with hp.SkipDTensorDispatch():
            torch.testing.assert_close(p1.grad._local_tensor, r1.grad, **TOL)
            opt.step()
    assert comm.get_comm_counts() == {"all_reduce": 1}, comm.get_comm_counts()
    ropt.step()
    torch.testing.assert_close(p2.full_tensor(), r2.detach(), **TOL)

    # 7. clip_grad_norm_ holds the grads it read before they were summed, then scales them
    p1, p2 = _params(mesh, w1, w2)
    r1, r2 = _ref(w1, w2)
    _loss(dx * 3, p1, p2).backward()
    _loss(x * 3, r1, r2).backward()
    norm = torch.nn.utils.clip_grad_norm_([p1, p2], 0.5)
    rnorm = torch.nn.utils.clip_grad_norm_([r1, r2], 0.5)
    torch.testing.assert_close(norm.full_tensor(), rnorm, **TOL)
    torch.testing.assert_close(p1.grad.full_tensor(), r1.grad, **TOL)
    torch.testing.assert_close(p2.grad.full_tensor(), r2.grad, **TOL)

    # 8. a plain tensor leaf (implicitly replicated scalar) and the plain leaf under from_local get
    #    their whole gradient: only DTensor leaves keep pieces
    s_plain = torch.tensor(0.7, dtype=DT, requires_grad=True)
    w_plain = w1.clone().requires_grad_(True)
    w_dt = hp.DTensor.from_local(w_plain, mesh, [Replicate()])
    ((dx * s_plain).sum() + (dx * w_dt).tanh().sum()).backward()
    s_ref, w_ref = torch.tensor(0.7, dtype=DT, requires_grad=True), w1.clone().requires_grad_(True)
    ((x * s_ref).sum() + (x * w_ref).tanh().sum()).backward()
    torch.testing.assert_close(s_plain.grad, s_ref.grad, **TOL)
    torch.testing.assert_close(w_plain.grad, w_ref.grad, **TOL)

    with pytest.raises(RuntimeError, match=r"torch.autograd.backward: grad can be implicitly created only for "
                                           r"scalar outputs; output 0 is a DTensor of global shape \(6, 5\)"):
        torch.autograd.backward([dx * p1])
    with pytest.raises(TypeError, match="the gradient of DTensor output 0 must be a DTensor, got Tensor"):
        torch.autograd.grad([dx * p1], [p1], [gy.chunk(ws)[0]])
    return True


def test_partial_grads_deferred_2(dist_runner):
    assert dist_runner.run(2, _partial_cases) == [True, True]


def test_partial_grads_deferred_4(dist_runner):
    assert dist_runner.run(4, _partial_cases) == [True] * 4


def _dp_tp_cases():
    """(dp=2, tp=2): replicate() over dp on a model whose weights have partial grads over tp."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(6, 5, dtype=DT, generator=g) for _ in range(2)]  # one batch per dp rank
    w1, w2 = torch.randn(5, dtype=DT, generator=g), torch.randn(5, dtype=DT, generator=g)
    b = torch.randn(3, dtype=DT, generator=g)
    tp_mesh = mesh["tp"]

    module = torch.nn.Module()
    module.w1, module.w2 = _params(tp_mesh, w1, w2)
    module.b = torch.nn.Parameter(b.clone())  # a plain parameter: dp average only
    replicate(module, mesh["dp"])
    r1, r2, rb = _ref(w1, w2, b)

    for step_scale in (1.0, -2.0):  # two backward passes accumulate
        dx = hp.distribute_tensor(xs[dp_rank] * step_scale, tp_mesh, [Shard(0)])
        loss = _loss(dx, module.w1, module.w2) + (module.b ** 2).sum() * (dp_rank + 1)
        with hp.CommDebugMode() as comm:
            loss.backward()
        # one dp average for all three parameters (one dtype); the tp sums stay pending
        assert comm.get_comm_counts() == {"all_reduce": 1}, comm.get_comm_counts()
        assert module.w1.grad.placements == (Partial(),)
        # reference: the mean over dp ranks of each rank's loss
        ref = sum(_loss(xs[i] * step_scale, r1, r2) + (rb ** 2).sum() * (i + 1) for i in range(2)) / 2
        ref.backward()
    torch.testing.assert_close(module.w1.grad.full_tensor(), r1.grad, **TOL)
    torch.testing.assert_close(module.w2.grad.full_tensor(), r2.grad, **TOL)
    torch.testing.assert_close(module.b.grad, rb.grad, **TOL)
    return True


def test_dp_average_and_partial_sum_fused_per_backward(dist_runner):
    assert dist_runner.run(4, _dp_tp_cases) == [True] * 4
