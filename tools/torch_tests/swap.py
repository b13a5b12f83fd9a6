#!/usr/bin/env python3
"""Produce hp/ (variant A) and hp_mesh/ (variant B) from orig/ by swapping the imports a
user would swap when moving from torch.distributed.tensor to hyper_parallel.

Variant A (hp/):      the imports ``python -m hyper_parallel.swap`` swaps (torch's meshes kept).
Variant B (hp_mesh/): as A, plus torch.distributed.device_mesh (``--swap-mesh``).

Which hyper_parallel object stands for each torch name comes from the one table the swap itself
uses (``hyper_parallel/compat/torch/swap_table.py``: ``home_of``), so these files import exactly
what a swapped program gets.

A name is swapped only where hyper_parallel has it; otherwise it stays imported from torch and
a comment records it (so a missing name shows up as failing tests, not as an ImportError that
hides the whole file).  Imports of torch internals (modules with a private component such as
torch.distributed.tensor._api, ._dtensor_spec, ._redistribute, ...) are left alone, and so are
imports inside function bodies.  swap_report.txt lists every swap, every kept name, and every
spot where a test body reaches torch.distributed.tensor directly.

Usage: .venv/bin/python tools/torch_tests/swap.py   (from the repository root)
"""
import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent
SRC = ROOT / "orig"
FILES = ["test_dtensor.py", "test_redistribute.py", "test_api.py",
         "parallel/test_tp_style.py", "parallel/test_parallelize_api.py"]

VARIANTS = {"hp": False, "hp_mesh": True}   # variant -> swap_mesh


def render(module, aliases):
    parts = [a if asname is None else f"{a} as {asname}" for a, asname in aliases]
    if len(parts) == 1:
        return f"from {module} import {parts[0]}\n"
    return f"from {module} import (\n" + "".join(f"    {p},\n" for p in parts) + ")\n"


def swap_file(text, swap_mesh, log):
    """``text`` with its module-level torch DTensor imports bound as the swap binds them (the one table)."""
    from hyper_parallel.compat.torch.swap_table import home_of, is_swapped
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    edits = []  # (start, end, new_text)
    for node in tree.body:  # module level only
        if not isinstance(node, ast.ImportFrom) or not node.module or not is_swapped(node.module, swap_mesh):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("torch.distributed.tensor") and a.asname:
                        log.append(f"  NOTE line {node.lineno}: module import `import {a.name} as {a.asname}` left as is")
            continue
        moved, kept = {}, []
        for a in node.names:
            home = home_of(node.module, a.name, swap_mesh)
            if home is None:
                kept.append((a.name, a.asname))
                continue
            module, attr = home
            asname = a.asname or (a.name if attr != a.name else None)
            moved.setdefault(module, []).append((attr, asname))
        new = ""
        for module, aliases in moved.items():
            new += render(module, aliases)
            log.append(f"  line {node.lineno}: {node.module} -> {module}: {', '.join(n for n, _ in aliases)}")
        if kept:
            new += f"# swap.py: not in hyper_parallel, kept from torch: {', '.join(n for n, _ in kept)}\n"
            new += render(node.module, kept)
            log.append(f"  line {node.lineno}: KEPT from {node.module} (missing in hyper_parallel): "
                       f"{', '.join(n for n, _ in kept)}")
        edits.append((node.lineno - 1, node.end_lineno, new))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = [new]
    return "".join(lines)


def report_spots(text, log):
    tree = ast.parse(text)
    top = set(id(n) for n in tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and id(node) not in top and node.module and node.module.startswith("torch.distributed"):
            log.append(f"  SPOT line {node.lineno}: function-level `from {node.module} import "
                       f"{', '.join(a.name for a in node.names)}` (left alone)")
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("from ", "import ", "#")):
            continue
        for m in re.finditer(r"torch\.distributed\.tensor\.[\w.]*|torch\.distributed\._tensor[\w.]*", line):
            log.append(f"  SPOT line {i}: inline `{m.group(0)}` in: {line.strip()[:110]}")
        if re.search(r"isinstance\([^)]*torch\.distributed", line):
            log.append(f"  SPOT line {i}: inline isinstance on torch type: {line.strip()[:110]}")


def main():
    sys.path.insert(0, str(ROOT.parents[1]))  # the repository root (hyper_parallel)
    out_log = []
    for variant, swap_mesh in VARIANTS.items():
        out_log.append(f"=== variant {variant} ===")
        for f in FILES:
            text = (SRC / f).read_text()
            log = []
            new = swap_file(text, swap_mesh, log)
            if variant == "hp":
                report_spots(text, log)
            dst = ROOT / variant / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(new)
            out_log.append(f"{f}:")
            out_log.extend(log)
    (ROOT / "swap_report.txt").write_text("\n".join(out_log) + "\n")
    print("\n".join(out_log))


if __name__ == "__main__":
    main()
