"""HyperParallel's ``hyper_parallel.core.*`` module paths, kept so its programs import unchanged.

Every module under ``core/`` is a facade with no logic: a few lines that alias the module where the
code lives (``dtensor/``, ``dispatch/``, ``tensor_parallel/``, ``fsdp/``, ``pipelining/``) or one of the
shims in ``compat/``. docs/design.md ("Module paths") has the table.
"""


def __getattr__(name):
    """``hp.core.dtensor.dtensor...`` as attribute access (the paths were imported eagerly before)."""
    import importlib
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from e
