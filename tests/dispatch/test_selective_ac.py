"""Selective activation checkpointing (torch's ``create_selective_checkpoint_contexts``, as torchtitan's
SelectiveAC applies it) over a TP block: the saved / recomputed op log must only hold the local ops,
not the dispatcher's shape inference; gradients equal one process (float64)."""
from __future__ import annotations


def _body():
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    import hyper_parallel as hp
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 24, bias=False), torch.nn.ReLU(),
                                   torch.nn.Linear(24, 8, bias=False)).double()
    blk, ref = mlp(), mlp()
    hp.parallelize_module(blk, mesh, {"0": hp.ColwiseParallel(), "2": hp.RowwiseParallel()})

    def policy(ctx, func, *a, **k):
        return CheckpointPolicy.MUST_SAVE if func is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    for _ in range(2):  # the second pass hits the dispatcher's caches (no shape inference at all)
        y = checkpoint(blk, x, use_reentrant=False,
                       context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        (y.full_tensor() if hasattr(y, "full_tensor") else y).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    for (n, p), q in zip(blk.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-12, atol=1e-12, msg=n)
    return True


def test_selective_ac_over_tp_block(dist_runner):
    assert dist_runner.run(2, _body) == [True, True]
