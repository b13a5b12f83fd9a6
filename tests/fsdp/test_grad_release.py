"""Gradients are released when they are dropped (issue 33, item 6: FSDP peak memory).

``zero_grad(set_to_none=True)`` must free a DTensor parameter's previous gradient: the cached
``.grad`` wrapper used to keep it (and so, under ``fully_shard``, the whole previous gradient shard)
alive through the next backward. 2 gloo ranks, a plain Shard(0) parameter and a fully_shard model;
the FSDP gradients also still match one process after the change.
"""
import gc
import time
import weakref

import torch

import hyper_parallel as hp
from hyper_parallel import Shard


def _body():
    mesh = hp.init_device_mesh("cpu", (2,))
    # a plain sharded parameter
    w = torch.nn.Parameter(hp.distribute_tensor(torch.randn(4, 3, dtype=torch.float64), mesh, [Shard(0)]))
    (w * w).sum().backward()
    g = w.grad  # caches the wrapper
    ref = weakref.ref(w.grad._local_tensor)
    del g
    w.grad = None
    assert ref() is None, "the previous gradient is still alive after grad = None"

    # fully_shard: the sharded gradients of the previous step are freed by zero_grad(set_to_none=True)
    torch.manual_seed(0)
    ref_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).double()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).double()
    model.load_state_dict(ref_model.state_dict())
    for m in model:
        hp.fully_shard(m, mesh=mesh)
    hp.fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    me = torch.distributed.get_rank()
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(x[2 * me: 2 * me + 2]).pow(2).sum().backward()
        ref_opt.zero_grad(set_to_none=True)
        (ref_model(x).pow(2).sum() / 2).backward()
        for p, rp in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), rp.grad, rtol=1e-12, atol=1e-12)
        refs = [weakref.ref(p.grad._local_tensor) for p in model.parameters()]
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        # gloo's worker thread may drop its reference to the last collective's arguments (full_tensor's
        # all_gather of a gradient shard) a moment later: allow it 2 s, then the gradient must be gone
        deadline = time.monotonic() + 2.0
        while any(r() is not None for r in refs) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert all(r() is None for r in refs), "a sharded gradient survived zero_grad(set_to_none=True)"
    return True


def test_dropped_gradients_are_freed(dist_runner):
    assert dist_runner.run(2, _body) == [True, True]
