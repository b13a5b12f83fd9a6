"""Which rule class serves which op: loaded once when hyper_parallel.dispatch is imported.

Each family module exposes ``register_all()`` that instantiates its rules (one
instance per op name). Users add rules for their own ops by instantiating a
:class:`~hyper_parallel.dispatch.rules.base.DistributedOp` subclass.
"""
from __future__ import annotations

import importlib

FAMILIES = (
    "elementwise",
    "matmul",
    "view",
    "reduction",
    "tensor_ops",
    "gather_ops",
    "triangular",
    "nn_ops",
    "foreach",
    "init_ops",
    "compare",
    "strided",
    "scatter_ops",
    "sort_ops",
    "padding_repeat",
    "conv",
    "counting",
    "random_ops",
    "device_ops",
    "grouped_mm",
    "complex_views",
)

_LOADED = False


def load_all():
    global _LOADED
    if _LOADED:
        return
    for fam in FAMILIES:
        try:
            mod = importlib.import_module(f"hyper_parallel.dispatch.rules.{fam}")
        except ModuleNotFoundError as exc:
            if exc.name == f"hyper_parallel.dispatch.rules.{fam}":
                # a family listed here whose file is gone would silently drop every rule it held
                raise ImportError(f"op_table.load_all: the rule family {fam!r} is listed in FAMILIES but "
                                  f"hyper_parallel/dispatch/rules/{fam}.py is missing; restore the file or "
                                  "remove the family from FAMILIES") from exc
            raise
        mod.register_all()
    _LOADED = True
