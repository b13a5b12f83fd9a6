"""HyperParallel's ``hyper_parallel.core.*`` module paths, kept so its programs import unchanged.

A facade with no logic. The modules of this package live in ``hyper_parallel/compat/hyperparallel/core/``
(all compatibility in one folder; docs/migrating_from_hyperparallel.md has the table): ``__path__``
points there, so ``import hyper_parallel.core.shard.api`` loads that folder's ``shard/api.py`` as
``hyper_parallel.core.shard.api``. Each of those files aliases the module where the code lives or holds
one of HyperParallel's own helpers.
"""
import importlib as _importlib
import os as _os

__path__ = [_os.path.join(_os.path.dirname(_os.path.dirname(__file__)), "compat", "hyperparallel", "core")]


def __getattr__(name):
    """``hp.core.dtensor.dtensor...`` as attribute access (the paths were imported eagerly before)."""
    try:
        return _importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from e
