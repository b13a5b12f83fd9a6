"""HyperParallel's ``hyper_parallel.core.dtensor.tensor_redistribution`` on top of ``redistribute``.

HyperParallel code calls ``_tensor_redistribution.redistribution(x, to_layout)`` and
``_tensor_redistribution.reduce_partial(x, to_layout)``; both run this library's planner
(``DTensor.redistribute``: cheapest plan, differentiable, cached), so there is one
redistribution engine. Only the dtensor layer is imported here (no op dispatcher).
"""
from __future__ import annotations

from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.dtensor.layout import Layout


def _check_dtensor(input_x, what):
    if not isinstance(input_x, DTensor):
        raise TypeError(f"TensorRedistribution.{what}: input_x must be a DTensor, got {type(input_x).__name__}")


def _tensor_layout(input_x: DTensor, to_layout, what: str) -> Layout:
    """``to_layout`` as a layout of ``input_x``'s rank (a ``layout(Shard(0))`` placement spec is completed)."""
    if hasattr(to_layout, "to_layout") and not isinstance(to_layout, Layout):  # a PlacementSpec
        to_layout = to_layout.to_layout(input_x.ndim)
    if not isinstance(to_layout, Layout):
        raise TypeError(f"TensorRedistribution.{what}: to_layout must be a Layout, got {type(to_layout).__name__}")
    if to_layout.dim_map is None:
        raise ValueError(f"TensorRedistribution.{what}: to_layout {to_layout!r} describes a device matrix only; "
                         "call it with the tensor's aliases first, e.g. layout('dp', 'None')")
    if len(to_layout.dim_map) != input_x.ndim:
        raise ValueError(f"TensorRedistribution.{what}: to_layout describes {len(to_layout.dim_map)} tensor dims "
                         f"but the DTensor has {input_x.ndim} (shape {tuple(input_x.shape)})")
    return to_layout


def _same_devices(input_x: DTensor, layout: Layout) -> bool:
    mesh = input_x.device_mesh
    return tuple(layout.mesh_shape) == tuple(mesh.mesh_shape) and list(layout.rank_list) == list(mesh.rank_list)


class TensorRedistribution:
    """HyperParallel's redistribution entry points (one shared instance: ``_tensor_redistribution``)."""

    @staticmethod
    def redistribution(input_x: DTensor, to_layout) -> DTensor:
        """``input_x`` laid out as ``to_layout`` (pending Partial reduced as the target needs).

        On the same devices this is ``input_x.redistribute`` to the layout (a ``Partial`` target is
        allowed here, as HyperParallel's internal callers use it); a layout on another mesh moves
        the data there (cross-mesh redistribution).
        """
        _check_dtensor(input_x, "redistribution")
        to_layout = _tensor_layout(input_x, to_layout, "redistribution")
        if _same_devices(input_x, to_layout):
            return input_x._redistribute(None, to_layout)
        return input_x.redistribute(to_layout.mesh, to_layout)

    @staticmethod
    def reduce_partial(input_x: DTensor, to_layout) -> DTensor:
        """Resolve ``input_x``'s pending ``Partial`` dims, as HyperParallel does.

        A partial mesh dim that ``to_layout`` shards some tensor dim over is reduce-scattered
        into that dim (appended as its innermost shard); the others are all-reduced. The
        other dims keep ``input_x``'s sharding. Without anything to scatter into this is
        ``input_x.reduce_partial()`` (HyperParallel's backward, see that method).
        """
        _check_dtensor(input_x, "reduce_partial")
        src = input_x._layout
        if not src.has_partial():
            return input_x
        to_layout = _tensor_layout(input_x, to_layout, "reduce_partial")
        if tuple(to_layout.mesh_shape) != tuple(src.mesh_shape):
            raise ValueError(f"TensorRedistribution.reduce_partial: mesh_shape of from_layout and to_layout must be "
                             f"the same, got {tuple(src.mesh_shape)} and {tuple(to_layout.mesh_shape)}")
        if to_layout.has_partial():
            raise ValueError(f"TensorRedistribution.reduce_partial: to_layout must have no Partial placement, got "
                             f"{list(to_layout.placements)}")
        dim_map = [tuple(dims) for dims in src.dim_map]
        scattered = False
        for d, op in enumerate(src.partial):
            if op is None:
                continue
            for t, dims in enumerate(to_layout.dim_map):
                if d in dims and d not in dim_map[t]:
                    dim_map[t] = dim_map[t] + (d,)
                    scattered = True
                    break
        if not scattered:
            return input_x.reduce_partial()
        target = src.with_dim_map(dim_map, (None,) * src.mesh_ndim)
        return input_x.redistribute(input_x.device_mesh, target)


_tensor_redistribution = TensorRedistribution()

__all__ = ["TensorRedistribution", "_tensor_redistribution"]
