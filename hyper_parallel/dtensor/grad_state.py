"""Gradient state of DTensors: gradient layouts, pending partial gradients, Partial leaves.

Helpers of :class:`~hyper_parallel.dtensor.dtensor.DTensor`'s ``grad``
property and of the special-cased ``backward`` (see docs/design.md, "Gradient
convention" and "Gradient reductions"). They take the DTensor as an argument and
build new ones with ``dt._wrap`` (its class), so this module does not import the
class.
"""
from __future__ import annotations

import weakref

import torch
from hyper_parallel.distributed import deferred_grads


_DG = deferred_grads  # partial gradients left pending after backward (see DTensor.grad)


def _grad_layout(layout):
    """The layout of the gradient of a tensor laid out as ``layout`` (Partial read as Replicate)."""
    return layout.without_partial() if layout.has_partial() else layout


def is_partial_leaf(local, layout) -> bool:
    """Whether ``local`` is the autograd leaf of a DTensor laid out ``Partial(avg/max/min/...)`` on some dim.

    PyTorch gives such a leaf the full gradient, ``Replicate`` (its redistribute backward reads a
    Partial source as Replicate), not each piece's share under the reduction's adjoint (``g / k``
    for avg, ``g`` masked to the winning rank for max/min), which is what a piece entering
    through ``from_local`` of a non-leaf tensor gets. ``Partial(sum)`` needs nothing: its adjoint
    is the full gradient already.
    """
    return (local.is_leaf and local.requires_grad and torch.is_grad_enabled()
            and any(op not in (None, "sum") for op in layout.partial))


def settle_pending_grads() -> None:
    """Sum every parameter gradient that backward left ``Partial`` (collective; all ranks call it alike).

    Done automatically the first time such a gradient is redistributed and on
    entering ``SkipDTensorDispatch``; call it before reading local gradients
    (``p.grad.to_local()``, ``p._local_tensor.grad``) that must be complete.
    """
    if _DG.has_pending():
        _DG.flush_pending()


def _with_partial_over(layout, mesh, group):
    """``layout`` with a pending sum on the mesh dim whose group is ``group`` (None if there is none)."""
    for d in range(mesh.ndim):
        if layout.partial[d] is None and d not in layout.sharded_mesh_dims() \
                and mesh.get_comm_group(d).ranks == group.ranks:
            partial = tuple("sum" if i == d else p for i, p in enumerate(layout.partial))
            return layout._derive(layout.dim_map, partial)
    return None


def grad_view(dtensor):
    """``dtensor.grad``: the local gradient wrapped as a DTensor (cached per local gradient tensor).

    As in PyTorch, a gradient that backward left partial (a replicated parameter
    applied to sharded activations, e.g. a norm weight under sequence parallelism)
    reports ``Partial`` on that mesh dim; no collective has run yet.
    """
    local = dtensor._local_tensor
    g = local.grad
    if g is None:
        return None
    cached = dtensor.__dict__.get("_grad_wrapper")
    if cached is not None and cached._local_tensor is g:
        return cached
    lay = dtensor._layout if dtensor.__dict__.get("_hp_partial_grad") else _grad_layout(dtensor._layout)
    group = _DG.partial_group(local) if _DG.has_pending() else None
    if group is not None:
        lay = _with_partial_over(lay, dtensor._mesh, group)
        if lay is None:  # the group is not a dim of this mesh: sum now
            _DG.flush_pending()
            lay = _grad_layout(dtensor._layout)
    w = dtensor._wrap(g, dtensor._mesh, lay, dtensor._gshape)
    if group is not None and lay.has_partial():
        w.__dict__["_hp_pending_grad"] = True
        _DG.note_view(local, w)
    dtensor.__dict__["_grad_wrapper"] = w
    return w


def _set_partial_grad(dtensor, piece):
    """Accumulate ``piece`` (this rank's part of a Partial gradient) into the Partial leaf ``dtensor``'s ``.grad``.

    The library's gradient convention keeps full gradients in local ``.grad``
    (docs/design.md); a Partial leaf given a Partial gradient directly
    (``x.backward(g)`` or ``x.grad = g`` with ``g`` laid out like ``x``) keeps the
    pieces instead, as PyTorch does, with no collective, and ``.grad`` reports the
    Partial layout. If autograd later accumulates an ordinary (full) gradient into
    the leaf, a hook first reduces the pieces, so the sum stays right.
    """
    local = dtensor._local_tensor
    if dtensor.__dict__.get("_hp_partial_grad") and local.grad is not None:
        local.grad = local.grad + piece
    else:
        local.grad = piece.clone()
    dtensor.__dict__["_hp_partial_grad"] = True
    dtensor.__dict__.pop("_grad_wrapper", None)
    if not dtensor.__dict__.get("_hp_partial_grad_hook"):
        ref = weakref.ref(dtensor)  # the local tensor's hook must not keep its wrapper alive

        def reduce_first(grad):
            dt = ref()
            if dt is not None and dt.__dict__.pop("_hp_partial_grad", None) and dt._local_tensor.grad is not None:
                full = dt._wrap(dt._local_tensor.grad, dt._mesh, dt._layout, dt._gshape)
                dt._local_tensor.grad = full.redistribute(dt._mesh, _grad_layout(dt._layout))._local_tensor
                dt.__dict__.pop("_grad_wrapper", None)
            return grad
        local.register_hook(reduce_first)
        dtensor.__dict__["_hp_partial_grad_hook"] = True


__all__ = ["settle_pending_grads", "grad_view"]
