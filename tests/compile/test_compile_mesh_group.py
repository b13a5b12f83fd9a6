"""``mesh.get_group(name)`` inside a compiled function (torchtitan's compiled loss-parallel cross
entropy reads ``pred.device_mesh.get_group("tp")``): traced like torch's ``DeviceMesh.get_group``,
the functional collective on that group gives the eager value."""
from __future__ import annotations


def _body():
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    import hyper_parallel as hp
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    x = hp.distribute_tensor(torch.arange(4.0 * ws, dtype=torch.float64), mesh, [hp.Shard(0)])

    def f(t):
        g = t.device_mesh.get_group("tp")
        return funcol.all_reduce(t.to_local() * 2, "sum", g)
    eager = f(x)
    eager = eager.wait() if hasattr(eager, "wait") else eager
    from hyper_parallel.compile import compile_mode
    try:
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    finally:
        compile_mode.restore_eager_fast_paths()  # leave the pool's worker as found (eager mode)
    want = torch.arange(4.0 * ws, dtype=torch.float64).view(ws, 4).sum(0) * 2
    torch.testing.assert_close(compiled, want)
    torch.testing.assert_close(eager, want)
    return True


def test_get_group_in_compiled_code(dist_runner):
    assert dist_runner.run(2, _body, timeout=240) == [True, True]
