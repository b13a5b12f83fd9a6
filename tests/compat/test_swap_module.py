"""``hyper_parallel.swap``: an unchanged ``torch.distributed.tensor`` package runs on hyper_parallel.

The swap rewrites the imports of the named packages only: their ``torch.distributed.tensor*`` /
``fsdp`` / ``pipelining`` names become hyper_parallel's, torch itself and other modules keep
torch's, and a name hyper_parallel lacks raises :class:`UnsupportedError` naming it when used.
The distributed test runs the torch tutorial program of ``test_swap_import.py`` (torch's imports,
unchanged) as a swapped package and compares it with one process.
"""
from __future__ import annotations

import os
import sys
import tempfile
import uuid

import pytest

from tests.compat.test_swap_import import PROGRAM, TORCH_IMPORTS, _reference

DEMO = '''"""a module written for torch.distributed.tensor"""
from __future__ import annotations
import torch
import torch.distributed.tensor
import torch.distributed.tensor._random
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, Replicate, distribute_tensor
from torch.distributed.tensor import init_device_mesh as dt_init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed._composable.fsdp import FSDPModule
import torch.distributed.tensor.parallel as tp_mod


def chained():
    return torch.distributed.tensor.DTensor, torch.distributed.tensor._random.manual_seed


def is_spec(x):
    return isinstance(x, DTensorSpec)


def make_spec():
    return DTensorSpec(None, None)
'''


def _write_pkg(src_by_name):
    root = tempfile.mkdtemp(prefix="hp_swap_")
    name = "swapdemo_" + uuid.uuid4().hex[:8]
    os.makedirs(os.path.join(root, name))
    with open(os.path.join(root, name, "__init__.py"), "w") as f:
        f.write("")
    for mod, src in src_by_name.items():
        with open(os.path.join(root, name, mod + ".py"), "w") as f:
            f.write(src)
    sys.path.insert(0, root)
    return root, name


def test_swap_rewrites_only_the_named_package():
    import importlib

    import torch.distributed.device_mesh as tdm
    import torch.distributed.tensor as tdt
    import hyper_parallel as hp
    from hyper_parallel import swap
    root, name = _write_pkg({"demo": DEMO, "other": "from torch.distributed.tensor import DTensor\n"})
    try:
        swap.install([name + ".demo"])
        demo = importlib.import_module(name + ".demo")
        other = importlib.import_module(name + ".other")
        assert demo.DTensor is hp.DTensor and demo.Shard is hp.Shard and demo.Replicate is hp.Replicate
        assert demo.distribute_tensor is hp.distribute_tensor and demo.parallelize_module is hp.parallelize_module
        assert demo.ColwiseParallel is hp.ColwiseParallel and demo.Placement is hp.Placement
        assert demo.local_map is hp.local_map and demo.fully_shard is hp.fully_shard
        assert demo.FSDPModule is hp.FSDPModule and demo.MixedPrecisionPolicy is hp.MixedPrecisionPolicy
        assert demo.tp_mod.ColwiseParallel is hp.ColwiseParallel
        # the mesh stays torch's unless --swap-mesh, also when imported from torch.distributed.tensor
        assert demo.DeviceMesh is tdm.DeviceMesh and demo.init_device_mesh is tdm.init_device_mesh
        assert demo.dt_init_device_mesh is tdm.init_device_mesh
        dt, seed = demo.chained()
        assert dt is hp.DTensor and seed.__module__ == "hyper_parallel.compat.torch.private_functions"
        # a module outside the scope, and torch itself, keep torch's names
        assert other.DTensor is tdt.DTensor and tdt.DTensor is not hp.DTensor
        # unsupported: named in the error when used, never a silent stand-in
        assert demo.is_spec(object()) is False
        with pytest.raises(swap.UnsupportedError, match=r"torch\.distributed\.tensor\._dtensor_spec\.DTensorSpec"):
            demo.make_spec()
        assert "torch.distributed.tensor._dtensor_spec.DTensorSpec" in swap.unsupported_names()
    finally:
        swap.uninstall()
        sys.path.remove(root)
    assert swap.unsupported_names() == []  # the run is over: a later run starts with a clean record


def test_swap_star_import_and_late_install_refused():
    import importlib

    from hyper_parallel import swap
    root, name = _write_pkg({"star": "from torch.distributed.tensor import *\n"})
    try:
        swap.install([name])
        with pytest.raises(ImportError, match=r"from torch\.distributed\.tensor import \*"):
            importlib.import_module(name + ".star")
        swap.uninstall()
        importlib.import_module(name)
        with pytest.raises(RuntimeError, match="already imported"):
            swap.install([name])
        with pytest.raises(ValueError, match="torch"):
            swap.install(["torch.distributed"])
    finally:
        swap.uninstall()
        sys.path.remove(root)


def _swapped_tutorial():
    import importlib

    import torch
    import torch.distributed as dist

    import hyper_parallel as hp
    from hyper_parallel import swap
    ws = dist.get_world_size()
    root, name = _write_pkg({"prog": TORCH_IMPORTS + PROGRAM})
    try:
        swap.install([name])
        prog = importlib.import_module(name + ".prog")
        assert prog.DTensor is hp.DTensor
        res = prog.main()
    finally:
        swap.uninstall()
        sys.path.remove(root)
    ref_losses, ref_weights = _reference(ws)
    torch.testing.assert_close(res["losses"], ref_losses, rtol=1e-5, atol=1e-6)
    for n, w in ref_weights.items():
        torch.testing.assert_close(res["weights"][n], w, rtol=1e-5, atol=1e-6, msg=n)
    return True


def test_swapped_torch_program_matches_one_process(dist_runner):
    assert dist_runner.run(2, _swapped_tutorial, timeout=240) == [True] * 2
