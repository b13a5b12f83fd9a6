"""The one piece of machinery behind HyperParallel's package paths (``hyper_parallel/core/*/__init__.py``).

A package facade re-exports its home package (``from home import *``) and resolves any other name
with :func:`package_getattr`: the home package's attribute, else one of the facade's own submodules
(HyperParallel's module names such as ``core.shard.ops.parallel_ops``), imported on first use.
"""
from __future__ import annotations

import importlib


def package_getattr(facade: str, home):
    """The module ``__getattr__`` of the package facade named ``facade`` over the package ``home``."""
    def __getattr__(name):
        try:
            return getattr(home, name)
        except AttributeError:
            try:
                return importlib.import_module(f"{facade}.{name}")
            except ModuleNotFoundError:
                raise AttributeError(f"module {facade!r} has no attribute {name!r}") from None
    return __getattr__
