"""All compatibility lives in ``hyper_parallel/compat/`` and the core selects HyperParallel's semantics in one place.

* every public path outside ``compat/`` that exists for HyperParallel's or PyTorch's spelling is a facade
  with no logic: no ``def``/``class``, only imports, a ``sys.modules`` alias or a ``__path__``;
* the core never asks which library a mesh follows: ``uses_hp_semantics`` is called only where meshes
  are made (``dtensor/device_mesh.py``); everything else asks ``semantics_of(mesh)`` one hook per concern;
* ``semantics_of`` answers PyTorch's defaults on a PyTorch mesh and HyperParallel's registered object
  on a HyperParallel one (single process, no groups needed: the answer reads only the mesh's flag).
"""
import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "hyper_parallel"

# public paths that are facades of compat/ (docs/design.md, "Module paths")
FACADES = ["core/__init__.py", "platform/__init__.py", "parallel/__init__.py", "placement_types.py", "device_mesh.py",
           "experimental.py", "swap.py", "swap_shims.py", "fsdp/hsdp.py"]


@pytest.mark.parametrize("path", FACADES)
def test_public_compat_paths_are_facades_without_logic(path):
    tree = ast.parse((PKG / path).read_text())
    defs = [n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.AsyncFunctionDef))
            or (isinstance(n, ast.FunctionDef) and n.name != "__getattr__")]
    assert defs == [], f"{path} defines {defs}; its code belongs in hyper_parallel/compat/"
    assert len(tree.body) <= 8, f"{path} has {len(tree.body)} statements; a facade is a few lines"


def test_core_has_no_files_but_its_facade():
    assert sorted(p.name for p in (PKG / "core").iterdir() if p.name != "__pycache__") == ["__init__.py"]


def _calls(path: Path, name: str):
    tree = ast.parse(path.read_text())
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "id", getattr(n.func, "attr", None)) == name]


def test_the_core_asks_semantics_of_not_the_library():
    hits = {}
    for sub in ("dtensor", "dispatch", "distributed", "compile", "checkpoint"):
        for path in (PKG / sub).rglob("*.py"):
            lines = _calls(path, "uses_hp_semantics")
            if lines and path.relative_to(PKG).as_posix() != "dtensor/device_mesh.py":
                hits[path.relative_to(PKG).as_posix()] = lines
    assert hits == {}, f"branches on the library outside the mesh: {hits}; ask semantics_of(mesh) instead"


def test_semantics_follow_the_mesh():
    import hyper_parallel  # noqa: F401  (the composition root registers HyperParallel's semantics)
    from hyper_parallel.compat.hyperparallel.semantics import HYPERPARALLEL
    from hyper_parallel.dtensor import mesh_semantics as ms

    class _Mesh:
        def __init__(self, hp):
            self._hp_flag = hp

    assert ms.hyperparallel() is HYPERPARALLEL
    assert ms.semantics_of(_Mesh(True)) is HYPERPARALLEL and ms.semantics_of(_Mesh(False)) is ms.TORCH
    assert ms.semantics_of(object()) is ms.TORCH  # a torch.distributed mesh has no flag
    torch_answers = {k: getattr(ms.TORCH, k) for k in vars(ms.MeshSemantics) if not k.startswith("_")
                     and not callable(getattr(ms.TORCH, k))}
    hp_answers = {k: getattr(HYPERPARALLEL, k) for k in torch_answers}
    assert torch_answers.pop("name") == "torch" and hp_answers.pop("name") == "hyperparallel"
    assert not any(torch_answers.values()) and all(hp_answers.values()), (torch_answers, hp_answers)
    with pytest.raises(TypeError, match="semantics must be a MeshSemantics, got int"):
        ms.register_hyperparallel(3)


def test_dropped_paths_are_this_projects_own_not_hyperparallels():
    for path in ("hyper_parallel.core.fsdp", "hyper_parallel.core.shard.local_map", "hyper_parallel.core.shard.skip",
                 "hyper_parallel.core.tensor_parallel.loss"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(path)
