"""Every mirrored module path (PyTorch's and HyperParallel's) re-exports its home objects, never copies.

For each facade module and each public name it offers, the object is the one defined in its home
module (``obj.__module__``), and the same object as ``hyper_parallel.<name>`` where the top level
has that name (the documented exception: ``init_device_mesh``, HyperParallel's at the top level and
PyTorch's in ``hyper_parallel.device_mesh``; docs/migrating_from_hyperparallel.md).
"""
import importlib
import inspect

import pytest

import hyper_parallel as hp

TORCH_STYLE = ["hyper_parallel.parallel", "hyper_parallel.parallel.style", "hyper_parallel.parallel.api",
               "hyper_parallel.parallel.loss", "hyper_parallel.placement_types", "hyper_parallel.experimental",
               "hyper_parallel.device_mesh", "hyper_parallel.debug", "hyper_parallel.fsdp",
               "hyper_parallel.checkpoint"]
HP_STYLE = ["hyper_parallel.core.dtensor", "hyper_parallel.core.dtensor.dtensor", "hyper_parallel.core.placement_types",
            "hyper_parallel.core.dtensor.placement_types", "hyper_parallel.core.dtensor.device_mesh",
            "hyper_parallel.core.dtensor.layout", "hyper_parallel.core.dtensor.random",
            "hyper_parallel.core.dtensor.tensor_redistribution", "hyper_parallel.core.shard",
            "hyper_parallel.core.shard.api", "hyper_parallel.core.shard.sharding_plan",
            "hyper_parallel.core.shard.dfunction", "hyper_parallel.core.shard.ops.parallel_ops",
            "hyper_parallel.core.shard.ops.parallel_ops_register", "hyper_parallel.core.shard._op_dispatch",
            "hyper_parallel.core.tensor_parallel", "hyper_parallel.core.tensor_parallel.style",
            "hyper_parallel.core.hsdp", "hyper_parallel.core.hsdp.api",
            "hyper_parallel.core.utils", "hyper_parallel.platform"]
TOP_LEVEL_DIFFERS = {("hyper_parallel.device_mesh", "init_device_mesh")}


def _public(mod):
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in vars(mod) if not n.startswith("_")]
    out = {}
    for n in names:
        obj = getattr(mod, n)
        if inspect.ismodule(obj):
            continue
        out[n] = obj
    return out


def _home(obj):
    home_mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None)
    if not isinstance(home_mod, str) or not home_mod.startswith("hyper_parallel") or not qual or "." in qual:
        return None  # constants, foreign objects (torch's), nested names: no home to compare with
    return getattr(importlib.import_module(home_mod), qual, None)


@pytest.mark.parametrize("path", TORCH_STYLE + HP_STYLE)
def test_mirrored_path_reexports_home_objects(path):
    mod = importlib.import_module(path)
    public = _public(mod)
    assert public, f"{path} exports nothing"
    for name, obj in public.items():
        home = _home(obj)
        if home is not None:
            assert obj is home, f"{path}.{name} is not the object defined in {obj.__module__}"
        if hasattr(hp, name) and (path, name) not in TOP_LEVEL_DIFFERS and not inspect.ismodule(getattr(hp, name)):
            assert obj is getattr(hp, name), f"{path}.{name} is not hyper_parallel.{name}"


def test_top_level_names_are_home_objects():
    for name in hp.__all__:
        obj = getattr(hp, name)
        home = _home(obj)
        if home is not None:
            assert obj is home, f"hyper_parallel.{name} is not the object defined in {obj.__module__}"
