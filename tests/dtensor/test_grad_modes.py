"""DTensor models under the modes training and evaluation code uses.

``torch.inference_mode`` (inference tensors have no version counter),
``torch.no_grad``, ``torch.autocast`` and activation checkpointing
(``torch.utils.checkpoint``, both implementations), each against the same
model on full tensors in one process.
"""
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import hyper_parallel as hp
from hyper_parallel import ColwiseParallel, Replicate, RowwiseParallel, Shard, parallelize_module
from tests.harness.parity import seeded_mlp

TOL = dict(rtol=1e-5, atol=1e-5)


def _grads(model):
    return [p.grad.full_tensor() if isinstance(p.grad, hp.DTensor) else p.grad for p in model.parameters()]


def _zero(*models):
    for m in models:
        for p in m.parameters():
            p.grad = None


def _modes_body():
    ws = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    ref, model = seeded_mlp(), seeded_mlp()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    want = ref(x).detach()

    # inference_mode: the model, ops that redistribute, and an in-place change between two
    # redistributions of the same tensor (no stale memo: inference tensors have no version counter)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want, **TOL)
        full = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
        d = hp.distribute_tensor(full, mesh, [Shard(0)])
        assert d.to_local().is_inference()
        torch.testing.assert_close(d.full_tensor(), full, rtol=0, atol=0)
        torch.testing.assert_close((d @ d.t()).full_tensor(), full @ full.t(), **TOL)
        d.mul_(2)
        torch.testing.assert_close(d.full_tensor(), 2 * full, rtol=0, atol=0)
    with torch.no_grad():
        out = model(x)
        assert not out.requires_grad
        torch.testing.assert_close(out, want, **TOL)

    # autocast (bf16 on CPU): same dtype as the reference, values to bf16 precision, grads flow
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, r = model(x), ref(x)
    assert out.dtype == r.dtype == torch.bfloat16
    torch.testing.assert_close(out, r, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    r.float().sum().backward()
    for g, rg in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(g, rg, rtol=5e-2, atol=5e-2)

    # activation checkpointing of a parallel module, both implementations
    for reentrant in (False, True):
        _zero(model, ref)
        xr = x.clone().requires_grad_(reentrant)  # reentrant checkpoint needs an input that requires grad
        checkpoint(model, xr, use_reentrant=reentrant).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        for g, rg in zip(_grads(model), _grads(ref)):
            torch.testing.assert_close(g, rg, **TOL)

    # checkpointing a function of DTensor activations (recomputed in backward, collectives included)
    w_full = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    xd = hp.distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    w = hp.distribute_tensor(w_full, mesh, [Shard(1)]).requires_grad_()
    fn = lambda a: torch.nn.functional.gelu(a @ w).sum()  # noqa: E731
    checkpoint(fn, xd, use_reentrant=False).backward()
    xf, wf = x.clone().requires_grad_(), w_full.clone().requires_grad_()
    torch.nn.functional.gelu(xf @ wf).sum().backward()
    torch.testing.assert_close(w.grad.full_tensor(), wf.grad, **TOL)
    torch.testing.assert_close(xd.grad.full_tensor(), xf.grad, **TOL)
    return True


def test_inference_autocast_checkpoint_2(dist_runner):
    assert dist_runner.run(2, _modes_body) == [True] * 2
