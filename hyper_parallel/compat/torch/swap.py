"""Run an unchanged ``torch.distributed.tensor`` program on hyper_parallel (opt-in import swap).

::

    python -m hyper_parallel.swap [--only PKG ...] [--swap-mesh] -m module [args ...]
    python -m hyper_parallel.swap [--only PKG ...] script.py [args ...]
    torchrun --nproc_per_node 4 -m hyper_parallel.swap --only torchtitan -m torchtitan.train ...

or, from Python, ``hyper_parallel.swap.install(["torchtitan"])`` before the program's first import.

How it works: a ``sys.meta_path`` finder takes over the loading of every module of the named
packages (``--only``; default: the top package of the ``-m`` module, or the script alone) and
compiles each one's source with its imports rewritten:

* ``from torch.distributed.tensor[.X] import name`` binds hyper_parallel's object of the mirrored
  path (:data:`MODULES`, the one table in ``compat/torch/swap_table.py``); ``import torch.distributed.tensor.X as m`` binds a proxy of that module;
  attribute chains such as ``torch.distributed.tensor._random.manual_seed`` in the code resolve
  the same way. Modules outside the named packages (torch itself, other libraries) are untouched,
  so torch keeps working internally, and modules that were already imported are not affected.
* Swapped: ``torch.distributed.tensor*`` (also the legacy ``torch.distributed._tensor``),
  ``torch.distributed.fsdp`` (and ``torch.distributed._composable.fsdp``) and
  ``torch.distributed.pipelining``; ``torch.distributed.device_mesh`` only with ``--swap-mesh``:
  by default the program keeps torch's meshes (``_unflatten``, ``_flatten`` and slicing are
  torch's own), which every hyper_parallel API accepts.
* A name hyper_parallel does not provide is bound to a placeholder that raises
  :class:`UnsupportedError` naming the torch name as soon as it is called, instantiated or an
  attribute of it is read (``isinstance(x, placeholder)`` is False: no hyper_parallel object is an
  instance of a torch-only class). A program that never uses the name runs; one that uses it
  stops with the name, never with silently different numbers. ``--strict`` raises
  :class:`UnsupportedImportError` (an ``ImportError`` naming the torch name) at import instead. :func:`unsupported_names` lists what a run bound to placeholders.

Limits: code that reaches these modules through another alias (``import torch.distributed as
dist; dist.tensor.DTensor``) or ``importlib.import_module("torch.distributed.tensor")`` is not
rewritten; the byte code of rewritten modules is not cached.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
import types
from typing import Dict, Iterable, List, Optional, Sequence

from hyper_parallel.compat.torch.swap_table import (FALLBACK_TO_TORCH, HINTS, MODULES, home_of, is_swapped,
                                                    module_mapping)

__all__ = ["install", "uninstall", "resolve", "module_proxy", "unsupported_names", "UnsupportedError",
           "UnsupportedImportError", "MODULES", "main"]


class UnsupportedError(NotImplementedError):
    """A torch name that hyper_parallel does not provide was used by a swapped program."""


class UnsupportedImportError(ImportError):
    """``--strict``: a swapped module imports a torch name that hyper_parallel does not provide.

    An ``ImportError`` (what ``from module import name`` raises for a missing name), not a
    ``RuntimeError``: lazy importers such as transformers' ``_LazyModule`` turn
    ``ModuleNotFoundError``/``RuntimeError`` into their own "Could not import module 'LlamaConfig'"
    and would hide the torch name; this error reaches the user with it. ``torch_name`` holds it.
    """

    def __init__(self, torch_name: str, message: str):
        module, _, name = torch_name.rpartition(".")
        super().__init__(message, name=module)
        self.torch_name = torch_name


_STATE = {"scope": (), "swap_mesh": False, "strict": False, "unsupported": {}, "finder": None}


def _mapping() -> Dict[str, str]:
    return module_mapping(_STATE["swap_mesh"])


def _swapped(modname: str) -> bool:
    return is_swapped(modname, _STATE["swap_mesh"])


def _is_module(modname: str) -> bool:
    """``modname`` names a swapped module (not a class or function inside one)."""
    if modname in _mapping():
        return True
    if not _swapped(modname):
        return False
    try:
        return importlib.util.find_spec(modname) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def _placeholder(torch_path: str):
    """A class standing for a torch name hyper_parallel does not provide (raises on use)."""
    msg = (f"{torch_path} is not supported by hyper_parallel (the program runs under hyper_parallel.swap); "
           "see docs/torchtitan.md for what is supported, or leave this package out of --only")
    if torch_path in HINTS:
        msg += f". {HINTS[torch_path]}"

    class _Meta(type):
        def __call__(cls, *args, **kwargs):
            raise UnsupportedError(msg)

        def __getattr__(cls, attr):
            if attr.startswith("__") and attr.endswith("__"):
                raise AttributeError(attr)
            raise UnsupportedError(f"{msg} (attribute {attr!r} read)")

        def __instancecheck__(cls, obj):
            return False

        def __subclasscheck__(cls, sub):
            return False

        def __repr__(cls):
            return f"<unsupported under hyper_parallel.swap: {torch_path}>"

    return _Meta(torch_path.rsplit(".", 1)[-1], (), {"__doc__": msg, "_hp_unsupported": torch_path})


def resolve(modname: str, name: str):
    """The object a swapped program gets for ``from modname import name``."""
    home = home_of(modname, name, _STATE["swap_mesh"])   # the one table (compat/torch/swap_table.py)
    if home is not None:
        mod, attr = home
        return getattr(importlib.import_module(mod), attr)
    if modname in _mapping():
        sub = f"{modname}.{name}"
        if sub in _mapping():  # `from torch.distributed.tensor import parallel`
            return module_proxy(sub)
        if modname.startswith(FALLBACK_TO_TORCH):
            torch_mod = importlib.import_module(modname)
            if hasattr(torch_mod, name):
                return getattr(torch_mod, name)
    path = f"{modname}.{name}"
    if _STATE["strict"]:
        raise UnsupportedImportError(path, f"{path} is not supported by hyper_parallel (hyper_parallel.swap "
                                           "--strict); leave its package out of --only, or run without --strict "
                                           "(the name then raises only when used)")
    obj = _STATE["unsupported"].get(path)
    if obj is None:
        obj = _STATE["unsupported"][path] = _placeholder(path)
    return obj


class _ModuleProxy(types.ModuleType):
    """What ``import torch.distributed.tensor.X as m`` binds: attribute reads go through :func:`resolve`."""

    def __init__(self, torch_name: str):
        super().__init__(torch_name)
        self.__dict__["_hp_torch_name"] = torch_name

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return resolve(self.__dict__["_hp_torch_name"], name)

    def __repr__(self):
        return f"<hyper_parallel.swap proxy of {self.__dict__['_hp_torch_name']}>"


_PROXIES: Dict[str, _ModuleProxy] = {}


def module_proxy(modname: str) -> _ModuleProxy:
    p = _PROXIES.get(modname)
    if p is None:
        p = _PROXIES[modname] = _ModuleProxy(modname)
    return p


def unsupported_names() -> List[str]:
    """The torch names a swapped program imported that hyper_parallel does not provide (placeholders)."""
    return sorted(_STATE["unsupported"])


# ---------------------------------------------------------------------------------------------- AST rewrite
_HELPER = "__hp_swap__"


def _dotted(node) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _call(helper_name: str, *args) -> ast.expr:
    return ast.Call(func=ast.Attribute(value=ast.Name(id=_HELPER, ctx=ast.Load()), attr=helper_name, ctx=ast.Load()),
                    args=[ast.Constant(a) for a in args], keywords=[])


class _Rewriter(ast.NodeTransformer):
    def __init__(self, package: Optional[str]):
        self.package = package
        self.changed = False
        self.torch_names = {"torch"}  # names bound to the torch package itself

    def _absolute(self, node: ast.ImportFrom) -> Optional[str]:
        if not node.level:
            return node.module
        return None  # relative imports never name torch

    def visit_ImportFrom(self, node: ast.ImportFrom):
        mod = self._absolute(node)
        if mod is None or not _swapped(mod):
            return node
        if any(a.name == "*" for a in node.names):
            raise ImportError(f"hyper_parallel.swap: `from {mod} import *` cannot be swapped; import names explicitly")
        self.changed = True
        out = []
        for a in node.names:
            out.append(ast.copy_location(ast.Assign(targets=[ast.Name(id=a.asname or a.name, ctx=ast.Store())],
                                                    value=_call("resolve", mod, a.name)), node))
        return out

    def visit_Import(self, node: ast.Import):
        keep, out = [], []
        for a in node.names:
            if a.asname and _swapped(a.name):
                self.changed = True
                out.append(ast.copy_location(ast.Assign(targets=[ast.Name(id=a.asname, ctx=ast.Store())],
                                                        value=_call("module_proxy", a.name)), node))
            else:
                keep.append(a)  # `import torch.distributed.tensor`: binds `torch`; chains rewritten below
        if keep:
            out.insert(0, ast.copy_location(ast.Import(names=keep), node))
        return out or None

    def visit_Attribute(self, node: ast.Attribute):
        dotted = _dotted(node)
        if dotted and dotted.split(".", 1)[0] == "torch" and isinstance(node.ctx, ast.Load):
            parts = dotted.split(".")
            # the longest swapped module prefix followed by at least nothing
            for cut in range(len(parts), 2, -1):
                mod = ".".join(parts[:cut])
                if _is_module(mod):
                    self.changed = True
                    expr = _call("module_proxy", mod)
                    for attr in parts[cut:]:
                        expr = ast.Attribute(value=expr, attr=attr, ctx=ast.Load())
                    return ast.copy_location(expr, node)
        self.generic_visit(node)
        return node


def rewrite_source(source: str, filename: str, package: Optional[str] = None):
    """Compile ``source`` with its torch DTensor imports swapped (module code object)."""
    tree = ast.parse(source, filename)
    rw = _Rewriter(package)
    tree = rw.visit(tree)
    if rw.changed:
        body = tree.body
        # after the docstring and `from __future__` imports
        i = 0
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            i = 1
        while i < len(body) and isinstance(body[i], ast.ImportFrom) and body[i].module == "__future__":
            i += 1
        helper = ast.parse(f"import hyper_parallel.swap as {_HELPER}").body[0]
        body.insert(i, helper)
    ast.fix_missing_locations(tree)
    return compile(tree, filename, "exec", dont_inherit=True)


class _SwapLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        source = self.get_data(self.get_filename(fullname))
        return rewrite_source(importlib.util.decode_source(source), self.get_filename(fullname))


class _SwapFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if not any(fullname == s or fullname.startswith(s + ".") for s in _STATE["scope"]):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = _SwapLoader(spec.loader.name, spec.loader.path)
        return spec


def install(packages: Iterable[str], *, swap_mesh: bool = False, strict: bool = False) -> None:
    """Swap the DTensor imports of every module of ``packages`` imported from now on."""
    packages = tuple(packages)
    if not packages:
        raise ValueError("hyper_parallel.swap.install: packages is empty; name the packages whose imports to swap")
    for p in packages:
        if p.split(".")[0] in ("torch", "hyper_parallel"):
            raise ValueError(f"hyper_parallel.swap.install: cannot swap the imports of {p!r} itself")
        already = [m for m, mod in list(sys.modules.items())   # (stand-in modules without a spec are not loaded code)
                   if (m == p or m.startswith(p + ".")) and getattr(mod, "__spec__", None) is not None]
        if already:
            raise RuntimeError(f"hyper_parallel.swap.install: {already[0]!r} is already imported; install the swap "
                               "before the program's first import")
    _STATE.update(scope=_STATE["scope"] + packages, swap_mesh=swap_mesh, strict=strict)
    import hyper_parallel  # noqa: F401  (before any swapped module runs)
    if _STATE["finder"] is None:
        _STATE["finder"] = _SwapFinder()
        sys.meta_path.insert(0, _STATE["finder"])


def uninstall() -> None:
    """Stop swapping; the run is over, so its record of placeholder names (``unsupported_names``) is cleared."""
    if _STATE["finder"] is not None:
        sys.meta_path.remove(_STATE["finder"])
    _STATE.update(scope=(), finder=None)
    _STATE["unsupported"].clear()


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m hyper_parallel.swap",
                                 description="run a torch.distributed.tensor program on hyper_parallel")
    ap.add_argument("--only", action="append", default=[], metavar="PKG",
                    help="package whose imports are swapped (repeatable; default: the -m module's top package)")
    ap.add_argument("--swap-mesh", action="store_true",
                    help="also swap torch.distributed.device_mesh for hyper_parallel.device_mesh")
    ap.add_argument("--strict", action="store_true", help="raise at import for names hyper_parallel lacks")
    ap.add_argument("-m", dest="module", help="run this module as __main__")
    # everything after the module / script belongs to the program
    if "-m" in argv:
        i = argv.index("-m")
        ours, module, rest = argv[:i], argv[i + 1] if i + 1 < len(argv) else None, argv[i + 2:]
        if module is None:
            ap.error("-m needs a module name")
        args = ap.parse_args(ours)
        args.module = module
        script = None
    else:
        args, rest = ap.parse_known_args(argv)
        if not rest:
            ap.error("give -m MODULE or a script path")
        script, rest = rest[0], rest[1:]
    if args.module:
        scope = args.only or [args.module.split(".")[0]]
        install(scope, swap_mesh=args.swap_mesh, strict=args.strict)
        sys.argv = [args.module] + rest
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        if args.only:
            install(args.only, swap_mesh=args.swap_mesh, strict=args.strict)
        else:
            _STATE.update(swap_mesh=args.swap_mesh, strict=args.strict)
        sys.argv = [script] + rest
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        with open(script, "rb") as f:
            code = rewrite_source(importlib.util.decode_source(f.read()), script)
        glb = {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__}
        exec(code, glb)


if __name__ == "__main__":
    from hyper_parallel.compat.torch.swap import main as _main  # the canonical module (its state is the one installed)
    _main()
