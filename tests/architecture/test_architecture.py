"""The package's shape is checked, not just described (docs/design.md, "Layers").

* ``lint-imports`` passes with the contracts in ``pyproject.toml`` (layers, the ground floor,
  torch-free layout math and planners, independent parallelisms), and *fails* on a copy of the
  package with one deliberately bad import, so the contracts are live; the pure-math contract
  also fails when a pure module reaches torch only through another module it imports;
* the import graph of ``hyper_parallel`` (every import statement, at module level and inside
  functions, as grimp reads them) has no cycle;
* the ground floor imports nothing above it, and only the compatibility facade names ``get_platform``.
"""
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "hyper_parallel"

grimp = pytest.importorskip("grimp")
pytest.importorskip("importlinter")


def _lint(cwd: Path, config: Path):
    exe = Path(sys.executable).with_name("lint-imports")
    env = dict(os.environ, PYTHONPATH=str(cwd))
    return subprocess.run([str(exe), "--no-cache", "--no-logo", str(config)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_lint_imports_contracts_hold():
    res = _lint(ROOT, ROOT / "pyproject.toml")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "broken" not in res.stdout.lower().replace("0 broken", ""), res.stdout[-4000:]


@pytest.mark.parametrize("module,line,contract", [
    ("dtensor/layout.py", "import hyper_parallel.dispatch.modes", "Layers"),
    ("dispatch/modes.py", "import hyper_parallel.tensor_parallel.style", "Layers"),
    ("compile/compile_mode.py", "import hyper_parallel.dispatch.dispatcher", "Layers"),
    ("checkpoint/dcp.py", "import hyper_parallel.dtensor.dtensor", "Layers"),
    ("distributed/differentiable.py", "import hyper_parallel.dtensor.placement_types", "The ground floor"),
    ("dtensor/redistribute_plan.py", "import torch", "Layout math and the pure planners"),
    # indirect: the pure modules' whole import closure is torch-free (device_mesh and the ground floor import torch)
    ("dtensor/layout_math.py", "import hyper_parallel.dtensor.device_mesh", "Layout math and the pure planners"),
    ("dtensor/placement_types.py", "import hyper_parallel.distributed.groups", "Layout math and the pure planners"),
    ("dtensor/layout_builder.py", "import hyper_parallel.compat.hyperparallel.platform", "The core (ground floor, DTensor"),
    ("dispatch/call_args.py", "import hyper_parallel.core.dtensor", "The core (ground floor, DTensor"),
    ("pipelining/split.py", "import hyper_parallel.fsdp.api", "Sibling parallelism packages are independent"),
    ("moe/plan.py", "import hyper_parallel.pipelining.split", "Sibling parallelism packages are independent"),
    ("context_parallel/plan.py", "import hyper_parallel.pipelining.split", "Sibling parallelism packages are independent"),
])
def test_contracts_are_live(tmp_path, module, line, contract):
    """One bad import in a copy of the package breaks the named contract."""
    shutil.copytree(PKG, tmp_path / "hyper_parallel", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "hyper_parallel" / module
    target.write_text(target.read_text() + f"\n{line}  # deliberately bad (test fixture)\n")
    res = _lint(tmp_path, tmp_path / "pyproject.toml")
    assert res.returncode != 0, res.stdout[-3000:]
    assert "BROKEN" in res.stdout and contract in res.stdout, res.stdout[-3000:]


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    mods = sorted(m for m in graph.modules if m.startswith("hyper_parallel"))
    succ = {m: sorted(x for x in graph.find_modules_directly_imported_by(m) if x.startswith("hyper_parallel"))
            for m in mods}
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in mods:
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(succ[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    graph = grimp.build_graph("hyper_parallel", cache_dir=None)
    cycles = _cycles(graph)
    assert cycles == [], "import cycles (module-level and deferred imports alike):\n" + "\n".join(map(str, cycles))


def test_cycle_finder_finds_a_cycle():
    class G:
        modules = {"hyper_parallel.a", "hyper_parallel.b", "hyper_parallel.c"}

        @staticmethod
        def find_modules_directly_imported_by(m):
            return {"hyper_parallel.a": {"hyper_parallel.b"}, "hyper_parallel.b": {"hyper_parallel.a"},
                    "hyper_parallel.c": {"hyper_parallel.a"}}[m]
    assert _cycles(G) == [["hyper_parallel.a", "hyper_parallel.b"]]


def test_ground_floor_imports_nothing_above_it():
    """Every module of hyper_parallel.distributed imports only the ground floor itself (and torch), as grimp reads it."""
    graph = grimp.build_graph("hyper_parallel", cache_dir=None)
    bad = {}
    for m in graph.find_descendants("hyper_parallel.distributed") | {"hyper_parallel.distributed"}:
        up = {i for i in graph.find_modules_directly_imported_by(m)
              if i.startswith("hyper_parallel") and not i.startswith("hyper_parallel.distributed")}
        if up:
            bad[m] = sorted(up)
    assert bad == {}, f"ground-floor modules importing the library above: {bad}"
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    floor = next(c for c in cfg if c.get("id") == "ground-floor")
    assert floor["source_modules"] == ["hyper_parallel.distributed"]
    top = {f"hyper_parallel.{p.stem}" for p in PKG.iterdir()
           if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert top - {"hyper_parallel.distributed", "hyper_parallel.auto"} <= set(floor["forbidden_modules"]), \
        sorted(top - set(floor["forbidden_modules"]))


def test_no_get_platform_outside_the_facade():
    """The Platform indirection is gone: only the compatibility facade names get_platform."""
    hits = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if "get_platform" in p.read_text())
    assert hits == ["compat/hyperparallel/platform.py", "platform/__init__.py"], hits
