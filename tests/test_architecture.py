"""The package's shape is checked, not just described (docs/design.md, "Layers").

* ``lint-imports`` passes with the contracts in ``pyproject.toml`` (layers, the platform root,
  no framework in core, independent parallelisms), and *fails* on a copy of the package with
  one deliberately bad import, so the contracts are live;
* the import graph of ``hyper_parallel`` (every import statement, at module level and inside
  functions, as grimp reads them) has no cycle;
* every module at the platform's root is covered by the platform-root contract.
"""
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
    ("core/dtensor/layout.py", "import hyper_parallel.core.shard.skip", "Layers"),
    ("core/shard/skip.py", "import hyper_parallel.core.tensor_parallel.style", "Layers"),
    ("distributed/differentiable.py", "import hyper_parallel.core.dtensor.placement_types", "platform's root"),
    ("core/dtensor/placement_types.py", "import torch", "Nothing in core imports a framework"),
    ("pipelining/split.py", "import hyper_parallel.core.fsdp.api", "Sibling parallelism packages are independent"),
    ("moe/plan.py", "import hyper_parallel.pipelining.split", "Sibling parallelism packages are independent"),
    ("moe/comm.py", "import hyper_parallel.moe.plan", "Layers"),
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


def test_every_platform_root_module_is_under_the_root_contract():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    root = next(c for c in cfg if c.get("id") == "platform-root")
    listed = set(root["source_modules"])
    found = set()
    for folder, prefix in ((PKG / "platform", "hyper_parallel.platform"),
                           (PKG / "platform" / "torch", "hyper_parallel.platform.torch")):
        for f in folder.glob("*.py"):
            if f.name != "__init__.py":
                found.add(f"{prefix}.{f.stem}")
    feature_folders = {"hyper_parallel.data_parallel", "hyper_parallel.pipelining",
                       "hyper_parallel.moe",
                       "hyper_parallel.context_parallel"}  # may import core (layers contract)
    for d in (PKG / "platform" / "torch").iterdir():
        if d.is_dir() and (d / "__init__.py").exists():
            name = f"hyper_parallel.platform.torch.{d.name}"
            if name not in feature_folders:
                found.add(name)
    assert found <= listed, f"platform modules not covered by the platform-root contract: {sorted(found - listed)}"
