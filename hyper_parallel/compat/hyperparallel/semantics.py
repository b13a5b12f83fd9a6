"""HyperParallel's semantics: its answers to the core's per-concern questions, registered in one place.

The mesh decides which library's semantics its DTensors follow (``dtensor/mesh_semantics.py``); the core
asks ``semantics_of(mesh)`` one attribute or method per concern. This module is HyperParallel's side of
every such question, so its behaviour lives here and not in branches over the core:

* plain tensors mixed with DTensors are replicated (``plain_tensors_replicated``);
* ``numpy()`` reads this rank's local piece (HyperParallel's DTensor is backed by the local storage);
* ``max(dim)`` / ``min(dim)`` over a sharded dim give Partial(max/min) values with global indices;
* ``clone()`` keeps a Partial input Partial;
* placement lists may be shorter than the mesh (padded) or longer (extras ignored, ``placement_lists.py``);
* a plain ``backward`` gradient is each rank's share (:meth:`HyperParallelSemantics.plain_backward_gradient`);
* strict-layout errors start with HyperParallel's own message (``strict_messages.py``), on every mesh.

:func:`register` hands the object to the core; ``hyper_parallel/__init__.py`` (the composition root)
calls it once. docs/migrating_from_hyperparallel.md describes each rule.
"""
from __future__ import annotations

from typing import Any

from hyper_parallel.compat.hyperparallel import placement_lists, strict_messages
from hyper_parallel.distributed import collectives
from hyper_parallel.dtensor import mesh_semantics
from hyper_parallel.dtensor.placement_types import Replicate


class HyperParallelSemantics(mesh_semantics.MeshSemantics):
    """HyperParallel's answers (see the module docstring); the defaults are PyTorch's."""

    name = "hyperparallel"
    plain_tensors_replicated = True
    numpy_reads_local_piece = True
    max_min_dim_partial = True
    clone_keeps_partial = True
    short_placement_lists = True

    def trim_placements(self, mesh: Any, placements: Any, what: str) -> Any:
        """A placement list longer than the mesh cut to its length (warning once; ``placement_lists.py``)."""
        return placement_lists.drop_extra_placements(mesh, placements, what, stacklevel=4)

    def plain_backward_gradient(self, dtensor: Any, gradient: Any) -> Any:
        """HyperParallel's reading of a plain ``backward`` gradient on its meshes: each rank's share.

        HyperParallel's autograd sums over ranks (the backward of its all_reduce is an
        all_reduce), so its programs seed ``loss.backward(1 / loss.layout.repeat_num())``:
        every rank holding a replica of the loss contributes its share and the shares add
        up to the whole gradient. Here the shares are summed over the mesh dims on which
        ``dtensor`` is replicated (one small all_reduce), which gives the same single-process
        gradients (docs/migrating_from_hyperparallel.md, "Gradient convention").
        """
        mesh = dtensor._mesh
        if mesh._coord is None:
            return gradient
        for mesh_dim, placement in enumerate(dtensor._layout.placements):
            if isinstance(placement, Replicate) and mesh.size(mesh_dim) > 1:
                gradient = collectives.all_reduce(gradient, mesh.get_comm_group(mesh_dim), "sum")
        return gradient

    @staticmethod
    def strict_message(name: str, dts: Any, args: Any, kwargs: Any):
        """``(exception class, HyperParallel's message)`` for a call strict layouts refuse, or None."""
        return strict_messages.message(name, dts, args, kwargs)

    @staticmethod
    def strict_semantic(name: str, dts: Any, args: Any, kwargs: Any):
        """HyperParallel's refusal of SDPA / scatter operands laid out unlike each other, or None."""
        return strict_messages.semantic(name, dts, args, kwargs)


HYPERPARALLEL = HyperParallelSemantics()


def register() -> None:
    """Hand HyperParallel's answers to the core (``dtensor.mesh_semantics.register_hyperparallel``)."""
    mesh_semantics.register_hyperparallel(HYPERPARALLEL)


__all__ = ["HyperParallelSemantics", "HYPERPARALLEL", "register"]
