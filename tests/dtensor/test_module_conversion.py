"""``module.to(dtype)``, ``.double()``, ``.to(device)`` and ``x.data = y`` with DTensor parameters.

``nn.Module._apply`` converts each parameter and, when
``torch._has_compatible_shallow_copy_type`` allows it, assigns the result with
``param.data = converted``, which keeps the Parameter object (and so an
optimizer's references). A DTensor parameter must come out with the new dtype on
its local tensor, its Python metadata and its C-level wrapper, keep its identity
and layout, convert its ``.grad`` too, and then compute exactly what the
converted single-process module computes.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hyper_parallel as hp
from hyper_parallel import ColwiseParallel, Replicate, RowwiseParallel, Shard, parallelize_module
from tests.harness.parity import seeded_mlp


def _wrapper_dtype(t):
    """The dtype the C++ side sees on the DTensor wrapper itself (not the local tensor)."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch._C.TensorBase.dtype.__get__(t)


def _module_to_double_body():
    ws = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    ref, model = seeded_mlp(), seeded_mlp()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8)
    # a first fp32 step, so that the parameters carry gradients into the conversion
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    before = {n: (p, p.layout) for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    assert model.double() is model
    ref.double()
    for n, p in model.named_parameters():
        assert p is before[n][0], f"{n}: the Parameter object was replaced"
        assert isinstance(p, nn.Parameter) and isinstance(p, hp.DTensor) and p.requires_grad
        assert p.layout == before[n][1], f"{n}: layout changed to {p.layout}"
        assert p.dtype == torch.float64 and p.to_local().dtype == torch.float64, n
        assert _wrapper_dtype(p) == torch.float64, f"{n}: wrapper still {_wrapper_dtype(p)}"
        assert p.grad is not None and p.grad.dtype == torch.float64, f"{n}: grad {p.grad.dtype}"
        assert p.grad.to_local().dtype == torch.float64
        torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[n].grad,
                                   rtol=1e-6, atol=1e-6)

    # the optimizer built before the conversion steps the converted parameters
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    xd = x.double()
    out, ref_out = model(xd), ref(xd)
    # the step used fp32 gradients (summed in another order on 2 ranks): fp32-level tolerance from here
    tol = dict(rtol=1e-6, atol=1e-6)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.full_tensor() if isinstance(out, hp.DTensor) else out, ref_out, **tol)
    out.pow(2).sum().backward()
    ref_out.pow(2).sum().backward()
    for n, p in model.named_parameters():
        r = dict(ref.named_parameters())[n]
        torch.testing.assert_close(p.full_tensor(), r.detach(), **tol)
        assert p.grad.dtype == torch.float64
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, **tol)

    # back to fp32, and to bf16 (dtype only), and a same-device .to() is a no-op
    model.float()
    assert all(p.dtype == torch.float32 and _wrapper_dtype(p) == torch.float32 for p in model.parameters())
    model.to(torch.bfloat16)
    assert all(p.to_local().dtype == torch.bfloat16 for p in model.parameters())
    model.to("cpu")
    assert all(p is before[n][0] for n, p in model.named_parameters())
    return True


def test_module_to_double_keeps_dtensor_parameters_2(dist_runner):
    assert dist_runner.run(2, _module_to_double_body) == [True] * 2


def _data_setter_body():
    ws = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,))
    a = hp.distribute_tensor(torch.arange(12.).reshape(6, 2), mesh, [Shard(0)])
    local = a._local_tensor
    b_full = torch.arange(20, dtype=torch.float64).reshape(4, 5)
    b = hp.distribute_tensor(b_full, mesh, [Replicate()])
    a.data = b
    # takes b's values and metadata, as a plain tensor does; keeps its local tensor object
    assert a._local_tensor is local
    assert a.shape == (4, 5) and a.placements == (Replicate(),) and a.dtype == torch.float64
    assert _wrapper_dtype(a) == torch.float64
    torch.testing.assert_close(a.full_tensor(), b_full)
    torch.testing.assert_close((a * 2).full_tensor(), b_full * 2)  # ops see the new metadata
    with pytest.raises(TypeError, match="DTensor.data must be a DTensor, got Tensor"):
        a.data = torch.zeros(4, 5)
    other = hp.init_device_mesh("cpu", (1, ws), mesh_dim_names=("x", "y"))
    with pytest.raises(ValueError, match="cannot move between meshes"):
        a.data = hp.distribute_tensor(b_full, other, [Replicate(), Replicate()])
    # torch._has_compatible_shallow_copy_type: True for two DTensors, False for a mixed pair
    assert torch._has_compatible_shallow_copy_type(a, b)
    assert not torch._has_compatible_shallow_copy_type(a, b_full)
    assert not torch._has_compatible_shallow_copy_type(b_full, a)
    return True


def test_data_setter_takes_value_and_metadata_2(dist_runner):
    assert dist_runner.run(2, _data_setter_body) == [True] * 2
