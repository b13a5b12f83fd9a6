"""Foreach and fused-optimizer ops over DTensors on several meshes (``dispatch/mesh_split.py``).

An optimizer over a model whose parameters live on two meshes (MoE experts on ``(efsdp, ep)``, the
rest on ``fsdp``) calls one ``_foreach_*`` / ``_fused_adamw_`` with all of them. Each result must equal
the op run on each tensor alone, in the original list order (the meshes interleaved), float64.
"""
from __future__ import annotations


def _body():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import hyper_parallel as hp
    ws = dist.get_world_size()
    world = init_device_mesh("cpu", (ws,), mesh_dim_names=("world",))
    a_mesh = world._unflatten(0, (ws,), ("fsdp",))["fsdp"]
    b_mesh = world._unflatten(0, (1, ws), ("efsdp", "ep"))["ep"]
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(5)]
    meshes = [a_mesh, b_mesh, a_mesh, b_mesh, b_mesh]  # interleaved
    xs = [hp.distribute_tensor(t, m, [hp.Shard(0)]) for t, m in zip(fulls, meshes)]
    ys = [hp.distribute_tensor(t * 0.5, m, [hp.Shard(0)]) for t, m in zip(fulls, meshes)]
    # out-of-place: results back in list order, each on its own mesh
    out = torch._foreach_add(xs, ys, alpha=2.0)
    assert [o.device_mesh for o in out] == [x.device_mesh for x in xs]
    for o, t in zip(out, fulls):
        torch.testing.assert_close(o.full_tensor(), t + 2.0 * t * 0.5, rtol=0, atol=0)
    # in-place with a plain scalar tensor (clip_grads_with_norm_'s _foreach_mul_)
    torch._foreach_mul_(xs, torch.tensor(3.0, dtype=torch.float64))
    for x, t in zip(xs, fulls):
        torch.testing.assert_close(x.full_tensor(), 3.0 * t, rtol=0, atol=0)
    # fused AdamW over both meshes equals fused AdamW on plain tensors
    params = [torch.nn.Parameter(hp.distribute_tensor(t, m, [hp.Shard(0)])) for t, m in zip(fulls, meshes)]
    ref = [torch.nn.Parameter(t.clone()) for t in fulls]
    for ps in (params, ref):
        opt = torch.optim.AdamW(ps, lr=0.1, eps=0.1, fused=True)
        for step in range(2):
            for i, p in enumerate(ps):
                gr = fulls[(i + step) % 5] * (i + 1)
                p.grad = gr if ps is ref else hp.distribute_tensor(gr, meshes[i], [hp.Shard(0)])
            opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach().full_tensor(), r.detach(), rtol=1e-14, atol=1e-14)
    return True


def test_foreach_and_fused_over_two_meshes(dist_runner):
    assert dist_runner.run(2, _body, timeout=120) == [True, True]
