"""The house in one look (issue 22, core side): import layers, no import cycles, public hooks.

The import graph is read from the source (every ``import`` statement, at module level
and inside functions, as import-linter's grimp reads it). Layers, bottom to top:
``platform`` < ``core.dtensor`` < ``core.shard`` < ``core.tensor_parallel`` / ``core.fsdp`` /
``core.hsdp`` / ``core.utils`` < ``debug`` < the rest. The public hooks that replaced
writes into private tables (``register`` / ``override``, ``register_special``,
``install_dispatcher``, ``provide_dtensor_names``, ``register_export``) are exercised on
real DTensors (2 ranks).
"""
from __future__ import annotations

import ast
import os
import sys
import textwrap

import pytest
import torch

import hyper_parallel
from hyper_parallel import Replicate, Shard

ROOT = os.path.dirname(hyper_parallel.__file__)


def import_graph(pkg_dir, pkg_name):
    """``{module: {(imported module, line)}}`` for every module under ``pkg_dir`` (all import statements)."""
    mods = {}
    for dirpath, _, files in os.walk(pkg_dir):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), pkg_dir)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            mods[".".join([pkg_name] + rel)] = os.path.join(dirpath, f)
    graph = {}
    for name, path in mods.items():
        edges = set()
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != name:
                    edges.add((t, node.lineno))
        graph[name] = edges
    return graph


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_scanner_sees_deferred_import_cycles(tmp_path):
    # the checks below would pass vacuously if the scanner missed imports inside functions
    pkg = tmp_path / "pk"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pk.b import g\n")
    (pkg / "b.py").write_text(textwrap.dedent("""
        def g():
            from pk import a  # deferred: still an edge
            return a
    """))
    graph = import_graph(str(pkg), "pk")
    assert ("pk.b", 1) in graph["pk.a"] and any(t == "pk.a" for t, _ in graph["pk.b"])
    assert cycles(graph) == [["pk.a", "pk.b"]]


def test_no_import_cycles_outside_platform():
    graph = import_graph(ROOT, "hyper_parallel")
    assert len(graph) > 100 and any(t == "hyper_parallel.core.dtensor.dtensor"
                                    for t, _ in graph["hyper_parallel.core.shard.dispatcher"])
    found = [c for c in cycles(graph) if not all(m.startswith("hyper_parallel.platform") for m in c)]
    assert found == [], found


_LAYERS = [("hyper_parallel.platform",), ("hyper_parallel.core.dtensor",), ("hyper_parallel.core.shard",),
           ("hyper_parallel.core.tensor_parallel", "hyper_parallel.core.fsdp", "hyper_parallel.core.hsdp",
            "hyper_parallel.core.utils"), ("hyper_parallel.debug",)]


def _level(mod):
    for i, prefixes in enumerate(_LAYERS):
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return i
    return len(_LAYERS)  # facades, checkpoint, the package root: the top


@pytest.mark.parametrize("layer", ["hyper_parallel.core.dtensor", "hyper_parallel.core.shard",
                                   "hyper_parallel.core.tensor_parallel"])
def test_core_imports_point_downwards(layer):
    graph = import_graph(ROOT, "hyper_parallel")
    mine = [m for m in graph if m == layer or m.startswith(layer + ".")]
    assert mine
    up = [(m, t, line) for m in mine for t, line in graph[m] if _level(t) > _level(m)]
    assert up == [], up


def test_core_does_not_import_the_framework():
    core = os.path.join(ROOT, "core")
    bad = []
    for dirpath, _, files in os.walk(core):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    tree = ast.parse(fh.read(), path)
                for node in ast.walk(tree):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                    bad += [(path, node.lineno, n) for n in names if n == "torch" or n.startswith("torch.")]
    assert bad == [], bad


def test_public_homes_are_the_same_objects():
    from hyper_parallel.core.dtensor import dispatch_state, dtensor
    from hyper_parallel.core.shard import _op_dispatch, dispatcher, modes, skip
    for name in ("implicit_replication", "add_no_skip_ops", "remove_no_skip_ops", "get_no_skip_ops",
                 "disable_dtensor_dispatch", "enable_dtensor_dispatch"):
        assert getattr(modes, name) is getattr(dispatch_state, name) is getattr(_op_dispatch, name), name
    assert modes.SkipDTensorDispatch is skip.SkipDTensorDispatch is dtensor.SkipDTensorDispatch \
        is hyper_parallel.SkipDTensorDispatch
    assert hyper_parallel.implicit_replication is modes.implicit_replication
    assert hyper_parallel.allow_replicate_fallback is modes.allow_replicate_fallback is \
        _op_dispatch.allow_replicate_fallback
    assert _op_dispatch._handle is dispatcher._handle and _op_dispatch._CACHE is dispatcher._CACHE
    assert dtensor.distribute_tensor is hyper_parallel.distribute_tensor
    import hyper_parallel.core.dtensor as pkg
    assert pkg.CommDebugMode is hyper_parallel.CommDebugMode


def test_hook_arguments_are_checked():
    from hyper_parallel.core.dtensor import _hp_compat, dtensor, register_export
    from hyper_parallel.core.shard import modes
    from hyper_parallel.core.shard.ops import base
    with pytest.raises(TypeError, match="install_dispatcher: handler must be callable, got 3"):
        dtensor.install_dispatcher(3)
    with pytest.raises(TypeError, match="register_special: fn must be callable, got 'x'"):
        dtensor.register_special(torch.Tensor.add, "x")
    with pytest.raises(ValueError, match=r"provide_dtensor_names: \['nope'\] are not HyperParallel"):
        _hp_compat.provide_dtensor_names(nope=1)
    with pytest.raises(ValueError, match="register_export: 'nope' is not one of"):
        register_export("nope", 1)
    with pytest.raises(TypeError, match="override: name must be a non-empty op name string, got 3"):
        base.override(3, None)
    with pytest.raises(TypeError, match="register: op must be a DistributedOp instance, got int"):
        base.register("mm", 3)
    with pytest.raises(TypeError, match="on_switch_change: fn must be callable"):
        modes.on_switch_change(None)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        dtensor.no_such_name  # noqa: B018


def _override_and_special():
    import hyper_parallel as hp
    from hyper_parallel.core.dtensor import dtensor as _dt
    from hyper_parallel.core.shard import dispatcher
    from hyper_parallel.core.shard.ops import base
    mesh = hp.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    a, b = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    da, db = hp.distribute_tensor(a, mesh, [Shard(1)]), hp.distribute_tensor(b, mesh, [Shard(0)])
    assert da.matmul(db).placements == (hp.Partial(),)  # the built-in rule: a pending sum

    class GatherFirst(base.DistributedOp):
        """mm by replicating both inputs first (a different, still correct plan)."""
        def strategy(self, call):
            rep = [lay.replicated() for lay in call.layouts]
            return base.Strategy(rep, rep[0])

    builtin = base.get_rule("matmul")
    rule = GatherFirst("matmul", register=False)
    assert base.get_rule("matmul") is builtin  # built, not registered
    with base.override("matmul", rule) as h:
        assert base.get_rule("matmul") is h.op and h.previous is builtin
        out = da.matmul(db)   # the caches were cleared: the override's plan runs
        assert out.placements == (Replicate(),)
        torch.testing.assert_close(out.to_local(), a @ b, rtol=0, atol=1e-12)
    assert base.get_rule("matmul") is builtin
    out = da.matmul(db)
    assert out.placements == (hp.Partial(),)
    torch.testing.assert_close(out.full_tensor(), a @ b, rtol=0, atol=1e-12)
    h.undo()  # a second undo is a no-op
    assert base.get_rule("matmul") is builtin

    # register_special: runs before any rule, undone exactly
    calls = []
    prev = _dt.register_special(torch.Tensor.exp, lambda x: calls.append(x) or "special")
    try:
        assert prev is None and da.exp() == "special" and calls == [da]
        assert dispatcher.handle(torch.Tensor.exp, (da,)) == "special"
    finally:
        _dt.unregister_special(torch.Tensor.exp, prev)
    e = da.exp()
    torch.testing.assert_close(e.full_tensor(), a.exp(), rtol=0, atol=0)
    assert len(calls) == 2
    return True


def test_override_and_register_special(dist_runner):
    assert dist_runner.run(2, _override_and_special) == [True, True]
