"""Issue 24, class 10: HyperParallel module paths that its user code imports (the seeds show them).

Public names are the library's own objects (identity, not copies) and behave as
HyperParallel's do on real gloo groups; private names HyperParallel code does not need here
raise an ImportError that says what to use instead.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard


# ----------------------------------------------------------------------------- no processes
def test_core_dtensor_package_exports_the_home_objects():
    from hyper_parallel.core.dtensor import (DTensor, DeviceMesh, Layout, Partial as P, distribute_tensor,
                                             init_device_mesh, ones, CommDebugMode)
    assert DTensor is hp.DTensor and Layout is hp.Layout and distribute_tensor is hp.distribute_tensor
    assert DeviceMesh is hp.DeviceMesh and init_device_mesh is hp.init_device_mesh and P is Partial
    assert ones is hp.ones and CommDebugMode is hp.CommDebugMode
    import hyper_parallel.core.dtensor as pkg
    assert "DTensor" in dir(pkg) and "distribute_tensor" in pkg.__all__
    with pytest.raises(AttributeError, match="no_such_name"):
        pkg.no_such_name  # noqa: B018


def test_other_seed_paths_are_the_home_objects():
    from hyper_parallel.core.dtensor.device_mesh import _mesh_resources
    from hyper_parallel.core.dtensor.tensor_redistribution import TensorRedistribution, _tensor_redistribution
    from hyper_parallel.core.shard._op_dispatch import (add_no_skip_ops, get_no_skip_ops, remove_no_skip_ops,
                                                        disable_dtensor_dispatch, enable_dtensor_dispatch)
    from hyper_parallel.core.utils import compute_local_shape_and_global_offset
    from hyper_parallel.core.dtensor.layout import _get_slice_tensor_by_layout  # noqa: F401
    assert isinstance(_tensor_redistribution, TensorRedistribution)
    assert callable(compute_local_shape_and_global_offset) and callable(_mesh_resources.get_current_mesh)
    assert get_no_skip_ops() == frozenset()
    add_no_skip_ops({"zeros_like", torch.ones_like})
    try:
        assert {"zeros_like", "ones_like", torch.ones_like} <= get_no_skip_ops()
    finally:
        remove_no_skip_ops({"zeros_like", torch.ones_like})
    assert get_no_skip_ops() == frozenset()
    with pytest.raises(TypeError, match="add_no_skip_ops: entries must be op names or callables, got 3"):
        add_no_skip_ops({3})


@pytest.mark.parametrize("name", ["differentiable_all_reduce", "p2p_exchange", "clip_grad_norm_",
                                  "EXISTING_COMM_GROUPS"])
def test_hyperparallel_internals_raise_importerror_naming_the_replacement(name):
    with pytest.raises(ImportError, match=rf"hyper_parallel\.core\.utils\.{name} .* is not provided"):
        exec(f"from hyper_parallel.core.utils import {name}", {})
    import hyper_parallel.core.utils as u
    assert not hasattr(u, "not_a_name")  # other names: a plain AttributeError


def test_current_mesh_error_without_a_mesh():
    from hyper_parallel.core.dtensor.device_mesh import _mesh_resources
    assert _mesh_resources.mesh_stack == []
    with pytest.raises(RuntimeError, match="No device mesh is currently active"):
        _mesh_resources.get_current_mesh()


def test_ceil_chunk_shape_and_offset_follow_torch_chunk():
    from hyper_parallel.core.utils import compute_local_shape_and_global_offset_by_ceil_chunk as f
    for n in range(0, 11):
        for k in range(1, 5):
            pieces = torch.arange(n).chunk(k) if n else ()
            for r in range(k):
                shape, off = f((3, n), 1, k, r)
                want = pieces[r] if r < len(pieces) else torch.empty(0, dtype=torch.long)
                assert shape == [3, want.numel()]
                if want.numel():
                    assert off == [0, int(want[0])]
    with pytest.raises(ValueError, match="shard_dim=2 is out of range"):
        f((3, 4), 2, 2, 0)
    with pytest.raises(ValueError, match="shard_rank=2"):
        f((3, 4), 1, 2, 2)


@pytest.mark.parametrize("module", ["hyper_parallel.core.dtensor.layout", "hyper_parallel.core.dtensor",
                                    "hyper_parallel.core.utils", "hyper_parallel.core.dtensor.tensor_redistribution",
                                    "hyper_parallel.core.dtensor.device_mesh"])
def test_each_path_imports_alone_in_a_fresh_interpreter(module):
    code = (f"import {module} as m, sys\n"
            "from hyper_parallel.core.dtensor import DTensor, Layout, distribute_tensor\n"
            "import hyper_parallel\n"
            "assert DTensor is hyper_parallel.DTensor\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


# ----------------------------------------------------------------------------- real processes
def _paths_body():
    import torch.distributed as dist
    from hyper_parallel.core.dtensor import DTensor, Layout, distribute_tensor
    from hyper_parallel.core.dtensor.device_mesh import _mesh_resources, init_device_mesh
    from hyper_parallel.core.dtensor.layout import _get_slice_tensor_by_layout
    from hyper_parallel.core.dtensor.tensor_redistribution import _tensor_redistribution
    from hyper_parallel.core.shard._op_dispatch import (add_no_skip_ops, disable_dtensor_dispatch,
                                                        enable_dtensor_dispatch, remove_no_skip_ops)
    from hyper_parallel.core.utils import compute_local_shape_and_global_offset
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = torch.randn(7, 5, dtype=torch.float64)  # uneven on both dims

    # compute_local_shape_and_global_offset: what the DTensor really holds, both spellings
    for pl in ([Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)], [Replicate(), Shard(0)],
               ("dp", "tp"), (("dp", "tp"), "None")):
        dt = distribute_tensor(full, mesh, pl)
        ls = compute_local_shape_and_global_offset(full.shape, mesh, pl)
        assert isinstance(ls, list) and ls == list(dt.to_local().shape), (pl, ls, dt.to_local().shape)
        off = ls.global_offset
        piece = full[off[0]:off[0] + ls[0], off[1]:off[1] + ls[1]]
        assert torch.equal(piece, dt.to_local()), pl
        assert ls.as_tuple() == (tuple(ls), off)
        # the local shape feeds a factory, as HyperParallel's _dtensor_init_helper does
        assert torch.equal(DTensor.from_local(piece, mesh, pl, shape=full.shape, stride=full.stride())
                           .full_tensor(), full)
        # _get_slice_tensor_by_layout: the same piece
        lay = dt.layout
        assert torch.equal(_get_slice_tensor_by_layout(full, lay), dt.to_local())
    with pytest.raises(ValueError, match="alias"):
        compute_local_shape_and_global_offset(full.shape, mesh, ("dp",))

    # _mesh_resources: reads the `with mesh:` stack of this thread
    with mesh:
        assert _mesh_resources.get_current_mesh() is mesh and _mesh_resources.mesh_stack[-1] is mesh
        with mesh["tp"]:
            assert _mesh_resources.get_current_mesh() == mesh["tp"]
            assert _mesh_resources.get_root_mesh(mesh["tp"]) == mesh
        z = hp.zeros(4, 4)  # the factory finds the same mesh
        assert z.device_mesh is mesh
    assert _mesh_resources.mesh_stack == []

    # tensor_redistribution: redistribution(x, layout) == redistribute, values and gradients
    x = distribute_tensor(full.clone().requires_grad_(), mesh, [Shard(0), Replicate()])
    to = Layout.from_device_mesh(mesh)("None", "tp")
    y = _tensor_redistribution.redistribution(x, to)
    assert y.placements == (Replicate(), Shard(1)) and torch.equal(y.full_tensor(), full)
    (y * y).sum().backward()
    assert torch.allclose(x.grad.full_tensor(), 2 * full)
    spec = Layout.from_device_mesh(mesh)(Shard(1), Replicate())  # a placement spec
    assert _tensor_redistribution.redistribution(x, spec).placements == (Shard(1), Replicate())

    # reduce_partial: Partial dp reduce-scattered into the dim to_layout shards over dp, or all-reduced
    pieces = full * (rank + 1)
    p = DTensor.from_local(pieces, mesh, [Partial(), Replicate()])
    total = full * sum(r + 1 for r in range(ws) if (r % (ws // 2)) == rank % (ws // 2))  # summed over dp
    s = _tensor_redistribution.reduce_partial(p, Layout.from_device_mesh(mesh)("dp", "None"))
    assert s.placements == (Shard(0), Replicate()) and torch.allclose(s.full_tensor(), total)
    r_ = _tensor_redistribution.reduce_partial(p, Layout.from_device_mesh(mesh)("None", "tp"))
    assert r_.placements == (Replicate(), Replicate()) and torch.allclose(r_.full_tensor(), total)
    assert _tensor_redistribution.reduce_partial(x, to) is x
    with pytest.raises(ValueError, match="must have no Partial"):
        _tensor_redistribution.reduce_partial(p, p.layout)
    with pytest.raises(ValueError, match="describes 1 tensor dims but the DTensor has 2"):
        _tensor_redistribution.redistribution(x, Layout.from_device_mesh(mesh)("dp"))

    # add_no_skip_ops / remove_no_skip_ops with HyperParallel's disable/enable pair
    dt = distribute_tensor(full, mesh, [Shard(0), Replicate()])
    disable_dtensor_dispatch()
    try:
        add_no_skip_ops({"zeros_like"})
        try:
            assert isinstance(torch.zeros_like(dt), DTensor)          # still dispatched
            assert not isinstance(dt * 2, DTensor)                     # skipped: local result
        finally:
            remove_no_skip_ops({"zeros_like"})
        assert not isinstance(torch.zeros_like(dt), DTensor)
    finally:
        enable_dtensor_dispatch()
    assert isinstance(dt * 2, DTensor)
    return True


def test_seed_paths_on_real_groups(dist_runner):
    assert dist_runner.run(4, _paths_body, timeout=240) == [True] * 4
