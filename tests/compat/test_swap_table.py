"""One import-swap table: ``python -m hyper_parallel.swap`` and ``tools/torch_tests/swap.py`` bind the same objects.

For a sample of torch DTensor imports (top level, parallel, placement_types, device_mesh, the renamed
FSDP private names, a name we lack), the tool's rewritten ``from ... import`` lines, executed, bind
exactly the objects the swap's ``resolve`` returns, with and without ``--swap-mesh``. Single process.
"""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SOURCE = """\
from torch.distributed.tensor import DTensor, DeviceMesh, init_device_mesh, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Replicate, Partial
from torch.distributed.tensor.device_mesh import init_device_mesh as tdm_init
from torch.distributed.device_mesh import DeviceMesh as MeshClass
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
"""
NAMES = [("torch.distributed.tensor", n) for n in ("DTensor", "DeviceMesh", "init_device_mesh", "Shard",
                                                  "distribute_tensor")] + [
    ("torch.distributed.tensor.parallel", "ColwiseParallel"), ("torch.distributed.tensor.parallel", "parallelize_module"),
    ("torch.distributed.tensor.placement_types", "Replicate"), ("torch.distributed.tensor.placement_types", "Partial"),
    ("torch.distributed.fsdp._fully_shard._fsdp_init", "_get_mesh_info"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")]


def _tool():
    path = ROOT / "tools" / "torch_tests" / "swap.py"
    spec = importlib.util.spec_from_file_location("torch_tests_swap_tool", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("swap_mesh", [False, True])
def test_tool_and_swap_bind_the_same_objects(swap_mesh):
    from hyper_parallel import swap
    tool = _tool()
    assert not any(hasattr(tool, name) for name in ("COMMON", "MAPPING")), "the tool keeps no table of its own"
    text = tool.swap_file(SOURCE, swap_mesh, [])
    bound = {}
    exec(compile(text, "<swapped>", "exec"), bound)
    old = swap._STATE["swap_mesh"]
    swap._STATE["swap_mesh"] = swap_mesh
    try:
        for module, name in NAMES:
            assert bound[name] is swap.resolve(module, name), (module, name, swap_mesh, text)
    finally:
        swap._STATE["swap_mesh"] = old
    import torch.distributed.device_mesh as tdm
    import hyper_parallel as hp
    mesh_home = hp.DeviceMesh if swap_mesh else tdm.DeviceMesh
    assert bound["DeviceMesh"] is mesh_home and bound["MeshClass"] is (hp.DeviceMesh if swap_mesh else tdm.DeviceMesh)
    assert bound["DTensor"] is hp.DTensor and bound["Partial"] is hp.Partial


def test_a_name_we_lack_stays_torchs_in_the_tool_and_is_a_placeholder_in_the_swap():
    from hyper_parallel import swap
    text = _tool().swap_file("from torch.distributed.tensor import DTensor, NoSuchTorchName\n", False, [])
    assert "from torch.distributed.tensor import NoSuchTorchName" in text
    assert swap.resolve("torch.distributed.tensor", "NoSuchTorchName").__name__ == "NoSuchTorchName"
    swap._STATE["unsupported"].pop("torch.distributed.tensor.NoSuchTorchName", None)
    assert "hyper_parallel" in sys.modules
