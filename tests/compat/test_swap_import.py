"""Swap the import: typical ``torch.distributed.tensor`` user code runs unchanged on hyper_parallel.

``PROGRAM`` is written the way PyTorch's DTensor and tensor-parallel tutorials
write it (device mesh, distribute_tensor / redistribute / from_local, a
Megatron-style FeedForward parallelized with Colwise/Rowwise styles and
SequenceParallel, CommDebugMode counts by torch's keys, an AdamW training loop,
``torch.testing`` on DTensors). It is executed twice on the same ranks: once
under PyTorch's imports and once with only the import block swapped for
hyper_parallel's. Both runs must succeed and agree (values, gradients' effect on
the weights, collective counts), and both must match a one-process reference.
"""
from __future__ import annotations

import pytest

TORCH_IMPORTS = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
"""

HP_IMPORTS = """
from hyper_parallel import init_device_mesh
from hyper_parallel import DTensor, Replicate, Shard, distribute_tensor
from hyper_parallel.debug import CommDebugMode
from hyper_parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                            SequenceParallel, parallelize_module)
"""

# Only the ``torch.distributed.tensor`` imports swapped: the mesh stays torch's own
# (``torch.distributed.device_mesh`` is not part of ``torch.distributed.tensor``).
HP_IMPORTS_TORCH_MESH = HP_IMPORTS.replace(
    "from hyper_parallel import init_device_mesh", "from torch.distributed.device_mesh import init_device_mesh")

# A mechanical prefix swap: ``torch.distributed.tensor`` -> ``hyper_parallel`` everywhere
# (``hyper_parallel.parallel``, ``.debug``, ... mirror torch's module layout).
HP_IMPORTS_PREFIX = TORCH_IMPORTS.replace("torch.distributed.tensor", "hyper_parallel")

PROGRAM = """
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

funcol = torch.ops.c10d_functional


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def main():
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    tp_mesh = mesh["tp"]
    out = {}

    # --- DTensor basics (torch.distributed.tensor docs)
    big = torch.arange(4.0 * ws * 6).reshape(4 * ws, 6)
    rowwise = distribute_tensor(big, tp_mesh, placements=[Shard(0)])
    assert rowwise.to_local().shape == (4, 6) and rowwise.shape == big.shape
    colwise = rowwise.redistribute(tp_mesh, [Shard(1)])
    replica = colwise.redistribute(placements=[Replicate()])
    torch.testing.assert_close(replica.to_local(), big)
    torch.testing.assert_close(colwise.full_tensor(), big)
    torch.testing.assert_close(rowwise, colwise.redistribute(tp_mesh, [Shard(0)]))  # DTensors compared
    local = torch.ones(2, 3) * (rank + 1)
    stitched = DTensor.from_local(local, tp_mesh, [Shard(0)])
    out["stitched"] = stitched.full_tensor()
    out["stride"] = stitched.stride()
    out["sum"] = (rowwise * 2).sum().full_tensor()
    with CommDebugMode() as comm_mode:
        rowwise.redistribute(tp_mesh, [Replicate()])
    out["gather_count"] = comm_mode.get_comm_counts()[funcol.all_gather_into_tensor]

    # --- tensor parallel FeedForward (TP tutorial): w1/w3 colwise, w2 rowwise, SP on the norm
    torch.manual_seed(0)
    model = FeedForward(16, 8 * ws)
    plan = {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w3": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    model = parallelize_module(model, tp_mesh, plan)
    assert isinstance(model.w1.weight, DTensor) and model.w1.weight.placements == (Shard(0),)
    assert model.w2.weight.placements == (Shard(1),)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(1)
    batch = torch.randn(2, 2 * ws, 16)
    losses = []
    for step in range(2):
        x = DTensor.from_local(batch.chunk(ws, dim=1)[rank], tp_mesh, [Shard(1)])
        with CommDebugMode() as comm_mode:
            y = model(x)
            loss = (y.full_tensor() ** 2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["losses"] = losses
    out["counts"] = comm_mode.get_total_counts()
    out["weights"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                      for n, p in model.named_parameters()}
    return out
"""


def _reference(ws):
    """The same FeedForward and loop on one process (no distribution)."""
    import torch
    ns = {}
    exec(PROGRAM, ns)
    torch.manual_seed(0)
    model = ns["FeedForward"](16, 8 * ws)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(1)
    batch = torch.randn(2, 2 * ws, 16)
    losses = []
    for _ in range(2):
        loss = (model(batch) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(imports):
    ns = {}
    exec(imports + PROGRAM, ns)
    return ns["main"]()


def _both():
    import torch
    import torch.distributed as dist
    ws = dist.get_world_size()
    res_torch = _run(TORCH_IMPORTS)
    res_hp = _run(HP_IMPORTS)
    res_hp_torch_mesh = _run(HP_IMPORTS_TORCH_MESH)
    res_hp_prefix = _run(HP_IMPORTS_PREFIX)
    ref_losses, ref_weights = _reference(ws)
    for res in (res_torch, res_hp, res_hp_torch_mesh, res_hp_prefix):
        torch.testing.assert_close(res["losses"], ref_losses, rtol=1e-5, atol=1e-6)
        for n, w in ref_weights.items():
            torch.testing.assert_close(res["weights"][n], w, rtol=1e-5, atol=1e-6, msg=n)
    for res in (res_hp, res_hp_torch_mesh, res_hp_prefix):
        for key in ("stitched", "stride", "sum", "gather_count"):
            assert res[key] == res_torch[key] if not isinstance(res[key], torch.Tensor) else \
                torch.equal(res[key], res_torch[key]), (key, res[key], res_torch[key])
        # the same collectives counted under both (hyper_parallel may fuse some: never more)
        assert 0 < res["counts"] <= res_torch["counts"], (res["counts"], res_torch["counts"])
    return True


def test_modules_mirror_torch_layout():
    """Every public name of torch's DTensor modules is importable from the hyper_parallel module of the same
    path (prefix swapped), as the same object as hyper_parallel's top-level name where there is one; the
    context manager
    ``context_parallel`` is ours too (``hyper_parallel.context_parallel``)."""
    import importlib
    import inspect

    import hyper_parallel as hp
    absent = set()
    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh_torch
    from hyper_parallel.device_mesh import init_device_mesh as mirrored
    assert mirrored is init_device_mesh_torch and hp.init_device_mesh is not mirrored
    for mod in ("", ".parallel", ".parallel.style", ".parallel.api", ".parallel.loss", ".placement_types",
                ".experimental", ".device_mesh", ".debug"):
        theirs = importlib.import_module("torch.distributed.tensor" + mod)
        ours = importlib.import_module("hyper_parallel" + mod)
        names = getattr(theirs, "__all__", None) or [n for n in vars(theirs) if n[0].isupper() or n.endswith("_module")]
        for name in names:
            if name in absent or (mod in (".parallel.style", ".parallel.api", ".parallel.loss", ".device_mesh")
                                  and not hasattr(hp, name)):  # modules without __all__: torch's imports
                continue
            assert hasattr(ours, name), f"hyper_parallel{mod}.{name} is missing"
            if (hasattr(hp, name) and (mod, name) != (".device_mesh", "init_device_mesh")
                    and not inspect.ismodule(getattr(hp, name))):  # hp.context_parallel is our package
                assert getattr(ours, name) is getattr(hp, name), f"hyper_parallel{mod}.{name}"
    from hyper_parallel.placement_types import _Partial
    assert _Partial is hp.Partial


@pytest.mark.parametrize("ws", [4])
def test_swap_import(dist_runner, ws):
    assert dist_runner.run(ws, _both, timeout=240) == [True] * ws
