"""Parameter names say what they hold (docs/design.md, "Names").

The share of function and method parameters whose name has 1 or 2 letters (``x``, ``t``, ``op``,
``fn``; leading underscores not counted; ``self``, ``cls`` and ``_`` not counted) over the
``hyper_parallel`` package, read with ``ast``, stays at or below torch's 1.6% (issue 39's
measure). Lambdas are not counted: their parameters are expressions' placeholders.

Exempt, each with its reason:

* **math kernels** (whole files): block math where the one-letter names are the notation of the
  formulas they implement (``q``, ``k``, ``v``, ``o``, ``l`` of attention; ``x @ w``);
* **signatures that mirror PyTorch or HyperParallel**: a function torch calls, or whose keywords a user
  passes, keeps the mirrored API's parameter names (``nn.init.uniform_(tensor, a, b)``,
  ``register_sharding(op)``, ``_StridedShard(sf=)``...), listed per parameter.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "hyper_parallel"

MAX_SHARE = 0.016      # torch's share of 1-2 letter parameter names (issue 39)
NOT_COUNTED = {"self", "cls", "_"}

MATH_KERNELS = {
    "context_parallel/kernels.py": "per-block attention math: q, k, v, o (out), l (log-sum-exp)",
    "dispatch/rules/grouped_mm_kernels.py": "grouped matmul x @ w per expert group",
}

MIRRORED_SIGNATURES = {   # (file, function, parameter): the signature it mirrors
    ("dispatch/rules/init_ops.py", "_uniform_", "a"): "torch.nn.init.uniform_(tensor, a, b)",
    ("dispatch/rules/init_ops.py", "_uniform_", "b"): "torch.nn.init.uniform_(tensor, a, b)",
    ("dispatch/rules/init_ops.py", "_kaiming_uniform_", "a"): "torch.nn.init.kaiming_uniform_(tensor, a, ...)",
    ("dispatch/rules/random_ops.py", "_geometric", "p"): "Tensor.geometric_(p) (called with torch's keywords)",
    ("dispatch/rules/nn_ops.py", "_normalize", "p"): "torch.nn.functional.normalize(input, p, dim, eps, out)",
    ("dispatch/rules/registered_sharding.py", "register_sharding", "op"): "torch's experimental register_sharding(op)",
    ("auto/dry_run.py", "dry_run", "lr"): "torch.optim's lr keyword (dry_run(..., lr=) builds the optimizer)",
    ("auto/dry_run.py", "measure_step", "lr"): "torch.optim's lr keyword",
    ("checkpoint/staging.py", "_offload_tensor", "x"): "torch's _ReplicationStager._offload_tensor(self, x, memo, ...)",
    ("dtensor/placement_types.py", "__init__", "sf"): "torch's _StridedShard(dim, split_factor=, sf=)",
    ("dtensor/layout_hp_methods.py", "set_partial_by_dev_axis", "op"): "HyperParallel's Layout.set_partial_by_dev_axis(axis, op)",
}

# Directories not yet measured (none: every package is).
PENDING: tuple = ()


def _short(name: str) -> bool:
    return len(name.lstrip("_")) <= 2


def _parameters(func: ast.AST):
    spec = func.args
    names = [arg.arg for arg in spec.posonlyargs + spec.args + spec.kwonlyargs]
    names += [arg.arg for arg in (spec.vararg, spec.kwarg) if arg is not None]
    return [name for name in names if name not in NOT_COUNTED]


def measure(source: str, path: str = "<source>"):
    """(parameters counted, [(path, line, function, name)] of the 1-2 letter ones) in ``source``."""
    counted, short = 0, []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for name in _parameters(node):
            if (path, node.name, name) in MIRRORED_SIGNATURES:
                continue
            counted += 1
            if _short(name):
                short.append((path, node.lineno, node.name, name))
    return counted, short


def measure_package():
    counted, short = 0, []
    for file in sorted(PKG.rglob("*.py")):
        rel = file.relative_to(PKG).as_posix()
        if rel in MATH_KERNELS or rel.startswith(PENDING):
            continue
        file_counted, file_short = measure(file.read_text(), rel)
        counted += file_counted
        short += file_short
    return counted, short


def test_short_parameter_names_at_most_torchs_share():
    counted, short = measure_package()
    share = len(short) / counted
    listing = "\n".join(f"  hyper_parallel/{path}:{line} {func}({name})" for path, line, func, name in short)
    print(f"1-2 letter parameter names: {len(short)} of {counted} = {share:.2%}")
    assert share <= MAX_SHARE, (f"{len(short)} of {counted} parameters ({share:.2%}) have 1-2 letter names, above "
                                f"torch's {MAX_SHARE:.1%}; name them for what they hold:\n{listing}")


def test_exemptions_exist():
    """Every exemption names a real file and function (a stale entry would hide nothing and mislead)."""
    for rel in MATH_KERNELS:
        assert (PKG / rel).is_file(), rel
    for path, func, param in MIRRORED_SIGNATURES:
        tree = ast.parse((PKG / path).read_text())
        assert any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == func
                   and param in _parameters(n) for n in ast.walk(tree)), (path, func, param)
    for prefix in PENDING:
        assert (PKG / prefix).exists(), prefix


@pytest.mark.parametrize("source,counted,expected", [
    ("def f(self, x, tensor, *a, **kw): pass", 4, [("x", 1), ("a", 1), ("kw", 1)]),
    ("class C:\n    def m(cls, _op, group): pass", 2, [("_op", 2)]),
    ("f = lambda t: t\ndef g(_, value): pass", 1, []),
])
def test_measure_counts_short_names(source, counted, expected):
    """The measure can fail: it finds short names (underscores stripped), skips self/cls/_ and lambdas."""
    got_counted, short = measure(source)
    assert got_counted == counted
    assert [(name, line) for _, line, _, name in short] == expected


def test_a_new_short_name_would_be_found():
    """A regression in a measured file shows up in the package measure's list."""
    counted, short = measure("def scale(t, factor):\n    return t * factor\n", "distributed/new.py")
    assert short == [("distributed/new.py", 1, "scale", "t")] and counted == 2
