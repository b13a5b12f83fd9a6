"""Type hints on the public API, checked (issue 39): every public function and method of the modules listed
in ``[tool.mypy] files`` (pyproject.toml) is fully annotated, and mypy passes on those modules.

The annotation check reads the source (ast), so it fails on a new unannotated public function even where
mypy, which skips unannotated bodies, would stay quiet. No processes.
"""
import ast
import pathlib
import subprocess
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    tomllib = None

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _public_api_files():
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["mypy"]["files"]


def _unannotated(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    missing = []

    def check(fn, owner=""):
        if fn.name.startswith("_") and fn.name != "__init__":
            return
        args = fn.args
        for i, arg in enumerate(args.posonlyargs + args.args + args.kwonlyargs):
            if i == 0 and owner and arg.arg in ("self", "cls"):
                continue
            if arg.annotation is None:
                missing.append(f"{path.relative_to(ROOT)}:{fn.lineno} {owner}{fn.name}({arg.arg})")
        for arg in (args.vararg, args.kwarg):
            if arg is not None and arg.annotation is None:
                missing.append(f"{path.relative_to(ROOT)}:{fn.lineno} {owner}{fn.name}(*{arg.arg})")
        if fn.returns is None and fn.name != "__init__":
            missing.append(f"{path.relative_to(ROOT)}:{fn.lineno} {owner}{fn.name} -> ?")

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            check(node)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    check(sub, node.name + ".")
    return missing


def test_public_functions_are_annotated():
    missing = [m for f in _public_api_files() for m in _unannotated(ROOT / f)]
    assert not missing, "public functions without type hints:\n" + "\n".join(missing)


def test_annotation_check_catches_a_missing_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = tmp_path / "bad.py"
    bad.write_text("def public(x) -> int:\n    return x\n\nclass C:\n    def m(self, y: int):\n        return y\n")
    assert len(_unannotated(bad)) == 2


def test_mypy_passes_on_the_public_api():
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
