"""HyperParallel's names in this package, in one place.

* The Layout / DeviceMesh surfaces are mixins in :mod:`.layout_hp_methods` and
  :mod:`._hp_mesh_compat` (re-exported here under their old path).
* ``hyper_parallel.dtensor.dtensor`` answers HyperParallel's imports of
  ``_build_layout``, ``_is_alias_placements``, ``SkipDTensorDispatch`` and the
  functions HyperParallel keeps in that module (``distribute_tensor``,
  ``distribute_module``, ``ones``...). The last live in ``api.py``, which imports
  ``dtensor.py``; ``api.py`` hands them over with :func:`provide_dtensor_names`
  when it is imported (as the package root always does), so ``dtensor.py`` never
  imports ``api.py``.
"""
from __future__ import annotations

from hyper_parallel.dtensor.layout_hp_methods import LayoutCompatMixin, PlacementSpec, unit_repeat_num
from hyper_parallel.dtensor.device_mesh_hp_methods import DeviceMeshCompatMixin
from hyper_parallel.dtensor.skip_and_replication import SkipDTensorDispatch
from hyper_parallel.dtensor.layout import Layout, is_alias_spelling
from hyper_parallel.dtensor.layout_builder import build_layout

# names HyperParallel imports from hyper_parallel.dtensor.dtensor that live in api.py here
DTENSOR_API_NAMES = frozenset({"distribute_tensor", "distribute_module", "ones", "empty", "full", "zeros", "rand",
                               "randn"})
_PROVIDED: dict = {"SkipDTensorDispatch": SkipDTensorDispatch}


def _build_layout(device_mesh, placements, tensor_dim: int) -> Layout:
    """HyperParallel's name: the (cached) layout of a ``tensor_dim``-d tensor from placements or aliases."""
    return build_layout(device_mesh, placements, tensor_dim)


_is_alias_placements = is_alias_spelling  # HyperParallel's name


def provide_dtensor_names(**objects) -> None:
    """Make ``objects`` importable from ``hyper_parallel.dtensor.dtensor`` (HyperParallel's module layout).

    Called by ``dtensor/api.py`` with the names in :data:`DTENSOR_API_NAMES`.
    """
    unknown = set(objects) - DTENSOR_API_NAMES
    if unknown:
        raise ValueError(f"provide_dtensor_names: {sorted(unknown)} are not HyperParallel dtensor-module names; "
                         f"expected some of {sorted(DTENSOR_API_NAMES)}")
    _PROVIDED.update(objects)


def dtensor_module_getattr(module_name: str, name: str):
    """``__getattr__`` of ``dtensor.py``: the HyperParallel names handed over by other modules."""
    try:
        return _PROVIDED[name]
    except KeyError:
        if name in DTENSOR_API_NAMES:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r} yet: it is defined in "
                                 "hyper_parallel.dtensor.api; import hyper_parallel first") from None
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}") from None


__all__ = ["LayoutCompatMixin", "DeviceMeshCompatMixin", "PlacementSpec", "unit_repeat_num"]
