"""DTensor API, creation functions, meshes and error messages on real process groups."""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard


def _api():
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("x",))
    # from_local with explicit shape/stride for uneven shards (torch.chunk: 5 rows -> 2,2,1,0 on 4 ranks)
    full = torch.arange(5.0 * 3).view(5, 3)
    local = full.chunk(ws)[rank] if rank < len(full.chunk(ws)) else full[5:]
    dt = hp.DTensor.from_local(local, mesh, [Shard(0)], shape=(5, 3), stride=(3, 1))
    assert dt.shape == (5, 3) and dt.size() == (5, 3) and dt.size(0) == 5 and dt.numel() == 15
    assert dt.ndim == 2 and dt.dim() == 2 and dt.local_shape == local.shape
    assert dt.dtype == torch.float32 and dt.device.type == "cpu" and not dt.requires_grad
    assert dt.placements == (Shard(0),) and dt.alias_placements == ("x", "None")
    assert dt.layout.placements == (Shard(0),) and "Shard(dim=0)" in repr(dt)
    torch.testing.assert_close(dt.full_tensor(), full)
    assert dt.to(torch.float64).dtype == torch.float64 and dt.to(torch.float64).placements == dt.placements
    assert dt.to(torch.float64).float().dtype == torch.float32
    # alias spelling
    assert hp.DTensor.from_local(local, mesh, ("x", "None"), shape=(5, 3), stride=(3, 1)).placements == (Shard(0),)
    if ws > 1:
        _run_check_1d(mesh, ws, rank)
    # to_local(grad_placements=[Partial()]) on a Replicate tensor all-reduces the gradient
    x = torch.ones(4, requires_grad=True)
    r = hp.DTensor.from_local(x, mesh, [Replicate()])
    out = r.to_local(grad_placements=[Partial()])
    (out * (rank + 1)).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), float(sum(range(1, ws + 1)))))
    # full_tensor gradient on a sharded leaf: its own slice
    s = hp.distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
    (s.full_tensor() * full).sum().backward()
    torch.testing.assert_close(s.grad.full_tensor(), full)
    assert isinstance(s.grad, hp.DTensor) and s.grad.placements == (Shard(1),)
    # a Partial tensor's gradient is Replicate (PyTorch's convention)
    p = hp.DTensor.from_local(torch.ones(3, requires_grad=True), mesh, [Partial()])
    p.full_tensor().sum().backward()
    assert p.grad.placements == (Replicate(),)
    # nn.Parameter holding a DTensor
    prm = nn.Parameter(hp.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
    assert isinstance(prm, nn.Parameter) and isinstance(prm, hp.DTensor) and prm.requires_grad and prm.is_leaf
    (prm * 2).sum().backward()
    assert isinstance(prm.grad, hp.DTensor)
    torch.testing.assert_close(prm.grad.full_tensor(), torch.full((4, 4), 2.0))
    # reduce_partial
    q = hp.DTensor.from_local(torch.ones(2) * (rank + 1), mesh, [Partial()])
    torch.testing.assert_close(q.reduce_partial().to_local(), torch.full((2,), float(sum(range(1, ws + 1)))))


def _run_check_1d(mesh, ws, rank):
    # a local shape that disagrees with the layout: rank 1 raises describing its shape, the others name rank 1
    bad = torch.zeros(3 if rank == 1 else 2, 3)
    if rank == 1:
        msg = (rf"rank 1 has local shape \(3, 3\) \(global shape \({3 * ws}, 3\)\), but with placements "
               rf"\(Shard\(dim=0\),\) and the global shape \({2 * ws}, 3\) of rank 0 it should have local shape "
               r"\(2, 3\); pass shape=")
    else:
        msg = r"the local shapes of rank\(s\) \[1\] do not match placements \(Shard\(dim=0\),\)"
    with pytest.raises(ValueError, match=msg):
        hp.DTensor.from_local(bad, mesh, [Shard(0)], run_check=True)
    # uneven shards pass with shape= (torch.chunk: 5 rows)
    rows = [c.shape[0] for c in torch.arange(5).chunk(ws)] + [0] * ws
    ok = hp.DTensor.from_local(torch.zeros(rows[rank], 3), mesh, [Shard(0)], run_check=True, shape=(5, 3), stride=(3, 1))
    assert ok.shape == (5, 3)
    # replicated data is broadcast from rank 0: every rank passes different data
    mine = torch.full((2, 3), float(rank))
    r = hp.DTensor.from_local(mine, mesh, [Replicate()], run_check=True)
    torch.testing.assert_close(r.to_local(), torch.zeros(2, 3))
    # ... also when the local tensor requires grad; its gradient passes through unchanged
    leaf = torch.full((2, 3), float(rank), requires_grad=True)
    r = hp.DTensor.from_local(leaf, mesh, [Replicate()], run_check=True)
    torch.testing.assert_close(r.to_local(), torch.zeros(2, 3))
    (r.to_local() * 3).sum().backward()
    torch.testing.assert_close(leaf.grad, torch.full((2, 3), 3.0))
    # without run_check nothing is exchanged
    assert torch.equal(hp.DTensor.from_local(mine, mesh, [Replicate()]).to_local(), mine)


def test_dtensor_api(dist_runner):
    for ws in (1, 2, 4):
        dist_runner.run(ws, _api)


def _creation():
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (ws,))
    # src_data_rank=0: ranks pass different data, everyone gets rank 0's
    mine = torch.full((4, 2), float(rank))
    d = hp.distribute_tensor(mine, mesh, [Shard(0)])
    torch.testing.assert_close(d.full_tensor(), torch.zeros(4, 2))
    # src_data_rank=None: no communication, local slicing
    with hp.CommDebugMode() as comm:
        d2 = hp.distribute_tensor(torch.arange(8.0).view(4, 2), mesh, [Shard(0)], src_data_rank=None)
    assert comm.get_total_counts() == 0
    torch.testing.assert_close(d2.full_tensor(), torch.arange(8.0).view(4, 2))
    with pytest.raises(ValueError, match="src_data_rank"):
        hp.distribute_tensor(mine, mesh, [Shard(0)], src_data_rank=ws)
    # as PyTorch: Partial distributes pending values whose sum is the tensor (sent from src_data_rank)
    p = hp.distribute_tensor(torch.arange(8.0).view(4, 2) + 100 * rank, mesh, [Partial()])
    assert p.placements == (Partial(),)
    torch.testing.assert_close(p.full_tensor(), torch.arange(8.0).view(4, 2))
    # distribute_module: partition_fn shards a Linear weight, the rest become Replicate DTensors
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    def partition(name, mod, m):
        if name == "0":
            mod.weight = nn.Parameter(hp.distribute_tensor(mod.weight.data, m, [Shard(0)]))
    calls = []
    hp.distribute_module(model, mesh, partition,
                         input_fn=lambda mod, inputs, m: (calls.append(("in3", mod is model, m is mesh)), inputs)[1],
                         output_fn=lambda mod, outputs, m: (calls.append(("out3", mod is model, m is mesh)), outputs)[1])
    assert model[0].weight.placements == (Shard(0),)
    assert model[0].bias.placements == (Replicate(),) and model[2].weight.placements == (Replicate(),)
    model(hp.distribute_tensor(torch.randn(3, 4), mesh, [Replicate()]))
    assert calls == [("in3", True, True), ("out3", True, True)]
    with pytest.raises(RuntimeError, match="only be called once"):
        hp.distribute_module(model, mesh)
    # 2-argument hooks (deprecated, still run): their return values replace the inputs / outputs
    m2 = nn.Linear(2, 2)
    calls2 = []

    def in2(inputs, m):
        calls2.append(("in2", m is mesh))
        return tuple(hp.distribute_tensor(i, m, [Replicate()]) for i in inputs)

    def out2(outputs, m):
        calls2.append(("out2", isinstance(outputs, hp.DTensor), m is mesh))
        return outputs.to_local()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        hp.distribute_module(m2, mesh, input_fn=in2, output_fn=out2)
    assert sum(issubclass(x.category, FutureWarning) for x in w) == 2
    inp = torch.arange(6.0).view(3, 2)   # the same on every rank (input_fn broadcasts rank 0's)
    out = m2(inp)   # a plain tensor in, a plain tensor out
    assert calls2 == [("in2", True), ("out2", True, True)]
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, inp @ m2.weight.full_tensor().T + m2.bias.full_tensor())
    with pytest.raises(ValueError, match="2 or 3 arguments"):
        hp.distribute_module(nn.Linear(2, 2), mesh, input_fn=lambda a: a)
    # factories (both spellings)
    o = hp.ones(5, 3, device_mesh=mesh, placements=[Shard(0)])
    assert o.shape == (5, 3) and o.placements == (Shard(0),)
    torch.testing.assert_close(o.full_tensor(), torch.ones(5, 3))
    z = hp.zeros((4, 4), mesh, [Shard(1)])
    torch.testing.assert_close(z.full_tensor(), torch.zeros(4, 4))
    f = hp.full((2, 3), 7.0, device_mesh=mesh, placements=[Replicate()], dtype=torch.float64)
    assert f.dtype == torch.float64 and f.to_local().eq(7).all()
    e = hp.empty(6, device_mesh=mesh, placements=[Shard(0)], requires_grad=True)
    assert e.shape == (6,) and e.requires_grad
    # random: replicas equal, shards differ, layout-independent with the same seed
    hp.manual_seed(3)
    rep = hp.rand(4, 4, device_mesh=mesh, placements=[Replicate()])
    gathered = [torch.empty(4, 4) for _ in range(ws)]
    dist.all_gather(gathered, rep.to_local())
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    hp.manual_seed(3)
    sh = hp.rand(4 * ws, 4, device_mesh=mesh, placements=[Shard(0)])
    pieces = sh.full_tensor().chunk(ws)
    if ws > 1:
        assert not torch.equal(pieces[0], pieces[1])
    return hp.randn  # marker


def test_creation(dist_runner):
    dist_runner.run(2, _creation)
    dist_runner.run(4, _creation)


def _rng_layouts():
    ws = dist.get_world_size()
    results = []
    meshes = [hp.init_device_mesh("cpu", (ws,)), hp.init_device_mesh("cpu", (2, ws // 2))]
    for mesh in meshes:
        for pl in ([Replicate()] * mesh.ndim, [Shard(0)] * mesh.ndim, [Shard(1)] + [Shard(0)] * (mesh.ndim - 1)):
            hp.manual_seed(11)
            results.append(hp.randn(7, 5, device_mesh=mesh, placements=pl).full_tensor())
    for r in results[1:]:
        assert torch.equal(r, results[0])
    return results[0]


def test_random_is_layout_independent(dist_runner):
    r4 = dist_runner.run(4, _rng_layouts)[0]
    r2 = dist_runner.run(2, _rng_layouts)[0]
    assert torch.equal(r4, r2)


def _mesh():
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
    assert mesh.ndim == 2 and mesh.shape == (2, ws // 2) and mesh.size() == ws and mesh.size("tp") == ws // 2
    assert mesh.get_coordinate() == (rank // (ws // 2), rank % (ws // 2)) and mesh.get_rank() == rank
    assert mesh.get_local_rank("dp") == rank // (ws // 2) and mesh.get_local_rank(1) == rank % (ws // 2)
    tp = mesh["tp"]
    assert tp.ndim == 1 and tp.mesh_dim_names == ("tp",) and rank in tp.rank_list
    assert mesh["dp", "tp"] is mesh
    assert dist.get_world_size(mesh.get_group("tp")) == ws // 2
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=tp.get_group())
    assert t.item() == sum(r for r in range(ws) if r // (ws // 2) == rank // (ws // 2))
    flat = mesh._flatten("dp_tp")
    assert flat.ndim == 1 and flat.size() == ws and flat.mesh_dim_names == ("dp_tp",)
    assert mesh.mesh.tolist() == [[r * (ws // 2) + c for c in range(ws // 2)] for r in range(2)]
    # the current mesh is used when the argument is omitted
    with mesh:
        x = hp.distribute_tensor(torch.ones(4, 4), placements=[Shard(0), Replicate()])
        assert x.device_mesh is mesh
        assert hp.ones(4, placements=[Replicate(), Replicate()]).device_mesh is mesh
    for shape in ((1, ws), (ws, 1)):
        m = hp.init_device_mesh("cpu", shape)
        y = hp.distribute_tensor(torch.arange(12.0).view(4, 3), m, [Shard(0), Shard(1)])
        torch.testing.assert_close(y.redistribute(m, [Replicate(), Shard(0)]).full_tensor(), torch.arange(12.0).view(4, 3))
    with pytest.raises(ValueError, match=rf"mesh_shape \({ws + 1},\) has {ws + 1} devices but the world size is {ws}"):
        hp.init_device_mesh("cpu", (ws + 1,))
    with pytest.raises(KeyError, match="'pp' not found"):
        mesh["pp"]
    # redistributing to another mesh moves the pieces point to point (more in tests/dtensor/test_cross_mesh.py)
    other = hp.init_device_mesh("cpu", (ws,))
    z = x.redistribute(other, [Shard(1)])
    assert z.device_mesh is other and z.placements == (Shard(1),)
    torch.testing.assert_close(z.full_tensor(), torch.ones(4, 4))
    assert "DeviceMesh('cpu', [0, 1," in repr(other) and "mesh_dim_names=('dp', 'tp')" in repr(mesh)
    with pytest.raises(ValueError, match="different meshes"):
        x + hp.ones(4, 4, device_mesh=hp.init_device_mesh("cpu", (ws // 2, 2)), placements=[Replicate()] * 2)
    # on PyTorch's meshes distribute_tensor wants one placement per mesh dim; other APIs pad short lists
    # (HyperParallel's meshes: tests/compat/test_hp_device_moves_and_mixed_inputs.py)
    from hyper_parallel.device_mesh import init_device_mesh as torch_init_device_mesh
    tmesh = torch_init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"`placements` must have the same length as `device_mesh.ndim`! "
                                         r"Found placements length: 1 \(\(Shard\(dim=0\),\)\), and device_mesh.ndim: 2"):
        hp.distribute_tensor(torch.ones(2), tmesh, [Shard(0)])
    assert hp.DTensor.from_local(torch.ones(2), tmesh, [Shard(0)]).placements == (Shard(0), Replicate())
    with pytest.raises(ValueError, match=r"has 3 entries but the mesh \(2, \d\) has 2 dims; the extra entry"):
        hp.DTensor.from_local(torch.ones(2), tmesh, [Shard(0), Replicate(), Shard(0)])
    with pytest.raises(RuntimeError, match="should be used to distribute leaf tensors"):
        hp.distribute_tensor(torch.ones(2, requires_grad=True) * 2, mesh, [Shard(0), Replicate()])
    d2 = hp.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)])
    assert hp.distribute_tensor(d2, mesh, [Shard(0), Shard(1)]) is d2
    with pytest.raises(ValueError, match="to a different placements"):
        hp.distribute_tensor(d2, mesh, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match="to a different device mesh"):
        hp.distribute_tensor(d2, hp.init_device_mesh("cpu", (ws,)), [Shard(0)])
    with pytest.raises(ValueError, match="out of range"):
        hp.distribute_tensor(torch.ones(2), mesh, [Shard(1), Replicate()])
    with pytest.raises(ValueError, match="unknown alias 'pp'"):
        hp.distribute_tensor(torch.ones(2, 2), mesh, ("pp", "None"))
    with pytest.raises(ValueError, match="used twice"):
        hp.distribute_tensor(torch.ones(2, 2), mesh, ("dp", "dp"))
    with pytest.raises(ValueError, match="Partial cannot be written as an alias"):
        hp.DTensor.from_local(torch.ones(2, 2), mesh, (Partial(), "None"))
    # run_check on a 2-d mesh: replicated data comes from tp rank 0 of each dp row; a bad shape names its rank
    d = hp.DTensor.from_local(torch.full((2, 2), float(rank)), mesh, [Shard(0), Replicate()], run_check=True)
    torch.testing.assert_close(d.to_local(), torch.full((2, 2), float(rank - rank % (ws // 2))))
    msg = r"rank 2 has local shape \(1, 2\)" if rank == 2 else r"the local shapes of rank\(s\) \[2\] do not match"
    with pytest.raises(ValueError, match=msg):
        hp.DTensor.from_local(torch.ones(1 if rank == 2 else 2, 2), mesh, [Shard(0), Replicate()], run_check=True)
    if ws == 8:
        _mesh_3d(rank)


def _mesh_3d(rank):
    """Slicing and flattening a ("pp", "dp", "tp") (2, 2, 2) mesh."""
    mesh = hp.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp, dp, tp = rank // 4, (rank // 2) % 2, rank % 2
    base = 4 * pp
    assert mesh.get_coordinate() == (pp, dp, tp)
    sub = mesh["dp", "tp"]
    assert sub.ndim == 2 and sub.shape == (2, 2) and sub.mesh_dim_names == ("dp", "tp") and sub.size() == 4
    assert sub.mesh.tolist() == [[base, base + 1], [base + 2, base + 3]]
    assert sub.get_coordinate() == (dp, tp) and sub.get_local_rank("dp") == dp and sub.get_local_rank("tp") == tp
    assert sub.get_rank() == rank and sub["tp"].rank_list == (rank - tp, rank - tp + 1)
    assert mesh["pp", "tp"].mesh.tolist() == [[2 * dp, 2 * dp + 1], [4 + 2 * dp, 5 + 2 * dp]]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=sub.get_group("dp"))
    assert t.item() == 2 * rank + 2 - 4 * dp   # rank + its dp partner (rank + 2 or rank - 2)
    # flatten dp x tp: one group of 4 ranks, reachable from the root mesh by name
    flat = sub._flatten()
    assert flat.mesh_dim_names == ("dp_tp",) and flat.ndim == 1 and flat.rank_list == tuple(range(base, base + 4))
    assert flat.get_local_rank() == rank % 4 and flat.get_coordinate() == (rank % 4,)
    assert mesh["dp_tp"] is flat and sub["dp_tp"] is flat and sub._flatten("dp_tp") is flat
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=flat.get_group())
    assert t.item() == sum(range(base, base + 4))
    p = hp.DTensor.from_local(torch.full((2,), float(rank)), flat, [Partial()])
    with hp.CommDebugMode() as comm:
        r = p.redistribute(flat, [Replicate()])
    assert comm.get_comm_counts() == {"all_reduce": 1}
    torch.testing.assert_close(r.to_local(), torch.full((2,), float(sum(range(base, base + 4)))))
    # a DTensor sharded over the flattened dim: values and gradient
    full = torch.arange(8.0 * 3).view(8, 3)
    x = hp.distribute_tensor(full, flat, [Shard(0)]).requires_grad_()
    torch.testing.assert_close(x.to_local(), full[2 * (rank % 4):2 * (rank % 4) + 2])
    (x.full_tensor() * full).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), full)
    with pytest.raises(ValueError, match="name 'tp' is already a dim of the root mesh"):
        sub._flatten("tp")
    with pytest.raises(ValueError, match=r"name 'dp_tp' already names the flattening of root dims \['dp', 'tp'\]"):
        mesh["pp", "dp"]._flatten("dp_tp")
    with pytest.raises(KeyError, match="'dp_tp' is a flattened dim; slice it alone"):
        mesh["pp", "dp_tp"]


def test_mesh_and_errors(dist_runner):
    dist_runner.run(4, _mesh)
    dist_runner.run(8, _mesh)
