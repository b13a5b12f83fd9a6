"""Executes redistribution plans on local tensors with differentiable collectives.

Every step maps to one autograd function of the ground floor (``distributed/differentiable.py``) whose backward
is the step's adjoint under the DTensor gradient convention, so the backward of
a redistribution is the reverse plan (with Replicate -> Partial skipped, as in
PyTorch). The output of an all_gather remembers its source so that consumers
that produce partial gradients can take a reduce_scatter backward path instead
of an all_reduce (see :func:`partial_grad_view`).
"""
from __future__ import annotations

from hyper_parallel.dtensor import redistribute_plan as rp
from hyper_parallel.compile import compile_mode
from hyper_parallel.distributed import deferred_grads
from hyper_parallel.distributed import differentiable

import torch

_F = differentiable
_D = deferred_grads
_GRAD_ENABLED = torch.is_grad_enabled
_COMPILING = compile_mode.is_compiling


def run_plan(local, plan: rp.Plan, mesh, rank_index: int):
    """Apply ``plan`` to this rank's ``local`` tensor; returns the new local tensor."""
    x = local
    for step in plan.steps:
        kind = step.kind
        if kind == "relabel":
            continue
        group = mesh.get_comm_group(step.mesh_dim)
        if kind == rp.ALL_GATHER:
            sizes = step.sizes[rank_index]
            src = x
            x = _F.AllGather.apply(x, step.tensor_dim, group, sizes, False)
            _remember_gather(x, src, step.tensor_dim, group, sizes)
        elif kind == rp.SPLIT:
            x = _F.Split.apply(x, step.tensor_dim, group, step.sizes[rank_index])
        elif kind == rp.ALL_REDUCE:
            x = _F.AllReduce.apply(x, group, step.reduce_op)
        elif kind == rp.REDUCE_SCATTER:
            x = _F.ReduceScatter.apply(x, step.tensor_dim, group, step.sizes[rank_index], step.reduce_op)
        elif kind == rp.ALL_TO_ALL:
            split_sizes, cat_sizes = step.sizes[rank_index]
            x = _F.AllToAll.apply(x, step.dst_dim, step.tensor_dim, group, split_sizes, cat_sizes)
        elif kind == rp.TO_PARTIAL:
            x = _F.ReplicateToPartial.apply(x, group, step.reduce_op)
        else:  # pragma: no cover - planner and executor are kept in sync
            raise AssertionError(f"unknown plan step {kind}")
    return x


def _remember_gather(out, src, dim, group, sizes):
    try:
        out._hp_gathered = (group.ranks, src, dim, group, sizes)
    except Exception:  # noqa: BLE001 - attribute storage is an optimisation only
        pass


def partial_grad_view(local, group, leave_partial: bool = True):
    """``local`` seen by a consumer whose gradient w.r.t. it is partial over ``group``.

    Returns a tensor equal to ``local`` whose backward sums the gradient over
    ``group`` once, however many consumers use it: the view is cached on
    ``local``. If ``local`` came from an all_gather over the same group, the
    backward is a reduce_scatter into the gathered source (Megatron's sequence
    parallel pairing) instead of an all_reduce. If ``local`` is a leaf (a
    parameter), the sum is deferred to the end of ``backward()`` and done for all
    such parameters in one flat all_reduce per group (Megatron's
    ``allreduce_layernorm_grads``; see ``distributed/deferred_grads.py``); a
    DTensor parameter's ``.grad`` is even left ``Partial`` until its first use,
    as in PyTorch, unless ``leave_partial`` is False (``to_local(grad_placements=)``,
    whose backward PyTorch reduces at once).
    """
    if group.size == 1 or not local.requires_grad or not _GRAD_ENABLED():
        return local
    if group.ranks in getattr(local, "_hp_grad_summed_over", ()):
        return local  # its owner sums the pieces itself (FSDP's unsharded parameter on a dp-mesh-dims mesh)
    # Keyed by the version counter: after an in-place update (optimizer step) a new view is made.
    key = (group.ranks, local._version, leave_partial)
    cache = getattr(local, "_hp_pgrad", None)
    if cache is None or cache.get("version") != local._version:
        cache = {"version": local._version}
        local._hp_pgrad = cache
    view = cache.get(key)
    if view is None:
        g = getattr(local, "_hp_gathered", None)
        if g is not None and g[0] == group.ranks and g[1].requires_grad:
            _, src, dim, grp, sizes = g
            view = _F.GatheredPartialGrad.apply(src, local.detach(), dim, grp, sizes)
        elif local.is_leaf and not _COMPILING():  # a parameter (compiled graphs reduce at once): one flat all_reduce at the end of backward for all of them
            view = _D.DeferredPartialGrad.apply(local, group, leave_partial)
        else:
            view = _F.PartialGrad.apply(local, group)
        cache[key] = view
    return view


class GradRedistribute(torch.autograd.Function):
    """Identity forward; backward runs ``plan`` on the gradient (for ``to_local(grad_placements=...)``)."""

    @staticmethod
    def forward(ctx, tensor, plan, mesh, rank_index):
        ctx.plan, ctx.mesh, ctx.rank_index = plan, mesh, rank_index
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad_output):
        if getattr(ctx, "hp_pass_pieces", False):  # already this rank's piece (dtensor/partial_grad_seed.py)
            return grad_output, None, None, None
        return run_plan(grad_output, ctx.plan, ctx.mesh, ctx.rank_index), None, None, None


class CastRedistribute(torch.autograd.Function):
    """``redistribute(forward_dtype=, backward_dtype=)``: cast, run ``fplan``; backward: cast, run ``bplan``.

    One autograd node, so the gradient's collectives really run in ``bwd_dtype``
    (the autograd engine would cast a gradient between separate nodes back to the
    forward dtype). ``bplan`` redistributes the gradient from the output's gradient
    layout to the input's, the adjoint of ``fplan`` under the DTensor gradient
    convention; the result is cast back to the input's dtype.
    """

    @staticmethod
    def forward(ctx, tensor, fplan, bplan, mesh, rank_index, fwd_dtype, bwd_dtype):
        ctx.bplan, ctx.mesh, ctx.rank_index, ctx.bwd, ctx.in_dtype = bplan, mesh, rank_index, bwd_dtype, tensor.dtype
        out = run_plan(tensor.to(fwd_dtype), fplan, mesh, rank_index)
        return out.clone() if out is tensor else out

    @staticmethod
    def backward(ctx, grad_output):
        gi = run_plan(grad_output.to(ctx.bwd), ctx.bplan, ctx.mesh, ctx.rank_index).to(ctx.in_dtype)
        return gi, None, None, None, None, None, None
