"""Which library's semantics a mesh's DTensors follow: the one query the core makes, one hook per concern.

The mesh decides. A mesh made by HyperParallel's entry points (``hyper_parallel.init_device_mesh``, a
``Layout``'s mesh) or sliced from one follows HyperParallel's semantics; every other mesh (PyTorch's
``init_device_mesh``, the ``DeviceMesh(...)`` constructor, ``torch.distributed`` meshes) follows PyTorch's.
:func:`semantics_of` turns that into an object, and the core asks that object one attribute or method per
concern (``semantics_of(mesh).numpy_reads_local_piece``...) instead of branching on the library.

PyTorch's answers are the defaults here (:class:`MeshSemantics`). HyperParallel's live with the rest of
its compatibility in ``hyper_parallel/compat/hyperparallel/semantics.py`` and are handed over once through
:func:`register_hyperparallel`, by the composition root (``hyper_parallel/__init__.py``), so the core
never imports compat (the ``core-below-compat`` contract). docs/migrating_from_hyperparallel.md lists
every difference. Pure Python: this module imports nothing.
"""
from __future__ import annotations

from typing import Any, Optional


class MeshSemantics:
    """The answers the core asks for, one per concern; these are PyTorch's (``TORCH``)."""

    name = "torch"
    #: plain tensors mixed with DTensors in an op are taken as replicated (PyTorch: an error)
    plain_tensors_replicated = False
    #: ``numpy()`` / ``__array__`` read this rank's local piece (PyTorch: the whole tensor, collectively)
    numpy_reads_local_piece = False
    #: ``max(dim)`` / ``min(dim)`` over a sharded dim give Partial(max/min) values with global indices
    max_min_dim_partial = False
    #: ``clone()`` keeps a Partial input Partial (PyTorch 2.13 reduces it: the result is Replicate)
    clone_keeps_partial = False
    #: ``distribute_tensor`` accepts a placement list shorter than the mesh (padded with ``Replicate()``)
    short_placement_lists = False

    def trim_placements(self, mesh: Any, placements: Any, what: str) -> Any:
        """A placement list longer than ``mesh`` as the library reads it (PyTorch: unchanged; checked later)."""
        return placements

    def plain_backward_gradient(self, dtensor: Any, gradient: Any) -> Any:
        """The plain tensor given to ``dtensor.backward(gradient)`` as the whole gradient (PyTorch: as is)."""
        return gradient

    def __repr__(self) -> str:
        return f"<{self.name} semantics>"


TORCH = MeshSemantics()
_HYPERPARALLEL: list = [None]


def register_hyperparallel(semantics: MeshSemantics) -> None:
    """Install HyperParallel's answers (called once by ``hyper_parallel/__init__.py``)."""
    if not isinstance(semantics, MeshSemantics):
        raise TypeError(f"register_hyperparallel: semantics must be a MeshSemantics, got {type(semantics).__name__}")
    _HYPERPARALLEL[0] = semantics


def hyperparallel() -> Optional[MeshSemantics]:
    """HyperParallel's registered answers (None before ``hyper_parallel`` is imported)."""
    return _HYPERPARALLEL[0]


def uses_hp_semantics(mesh: Any) -> bool:
    """Whether DTensors on ``mesh`` follow HyperParallel's semantics rather than PyTorch's.

    True for meshes made by HyperParallel's entry points (``hyper_parallel.init_device_mesh``,
    ``hyper_parallel.dtensor.device_mesh.init_device_mesh``, a ``Layout``'s mesh) and
    meshes sliced or flattened from them; False for PyTorch's (``hyper_parallel.device_mesh``,
    the ``DeviceMesh(...)`` constructor, ``torch.distributed`` meshes). Where the two libraries
    differ, the rule is in docs/migrating_from_hyperparallel.md.
    """
    return bool(getattr(mesh, "_hp_flag", False))


def semantics_of(mesh: Any) -> MeshSemantics:
    """The answers for DTensors on ``mesh`` (the mesh decides; see the module docstring)."""
    if not getattr(mesh, "_hp_flag", False):
        return TORCH
    semantics = _HYPERPARALLEL[0]
    if semantics is None:
        raise RuntimeError("a mesh made by HyperParallel's entry points is used before HyperParallel's semantics are "
                           "registered; import hyper_parallel (its __init__ registers them) before using the mesh")
    return semantics


__all__ = ["MeshSemantics", "TORCH", "register_hyperparallel", "hyperparallel", "uses_hp_semantics",
           "semantics_of"]
