"""``ExpertParallel`` and ``ExpertTensorParallel``: torchtitan's parallel styles for grouped experts.

Applied with ``parallelize_module(experts, ep_mesh, ExpertParallel())`` (or as a plan entry,
``{"experts": ExpertParallel()}``) to a module following the GroupedExperts contract:

* 3-D parameters ``w1``, ``w3`` ``[E, hidden, dim]`` and ``w2`` ``[E, dim, hidden]`` (any other 3-D
  parameter with ``E`` rows is sharded the same way);
* ``forward(routed_input, num_tokens_per_expert)``: ``routed_input`` ``[T, dim]`` with rows grouped
  by expert id in increasing order, ``num_tokens_per_expert`` ``[E]`` integers; returns ``[T, dim]``
  in the same row order.

The style shards the 3-D parameters ``Shard(0)`` (experts) on the EP mesh and wraps the forward:
before it, the count exchange and the token all_to_all (:func:`.dispatch.dispatch_sorted`); the
module's own forward then sees the rows of its local experts grouped by local expert and a
``num_tokens_per_expert`` of length ``E / ep``, and uses its local weights (``w.to_local()``, as
torchtitan's GroupedExperts does for DTensor parameters); after it, the inverse all_to_all puts the
rows back in the caller's order. Forward and backward are exact (the backward of each all_to_all is
the inverse all_to_all).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hyper_parallel.dtensor.api import distribute_tensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh, resolve_mesh
from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.dtensor.placement_types import Replicate, Shard
from hyper_parallel.tensor_parallel.style import ParallelStyle
from hyper_parallel.moe import plan as _plan
from hyper_parallel.moe.token_exchange import dispatch_sorted


def _num_experts(module, what):
    sizes = {name: p.shape[0] for name, p in module.named_parameters(recurse=False) if p.dim() == 3}
    if not sizes:
        raise ValueError(f"{what}: {type(module).__name__} has no 3-D expert parameters ([E, ., .] such as w1, w2, "
                         f"w3); apply it to the grouped-experts module (e.g. plan key 'experts')")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{what}: the 3-D expert parameters of {type(module).__name__} disagree on the number "
                         f"of experts (dim 0): {sizes}")
    return next(iter(sizes.values()))


def _distribute(module, name, mesh, placements, src_data_rank):
    p = getattr(module, name)
    if isinstance(p, DTensor):
        raise ValueError(f"parameter {name!r} of {type(module).__name__} is already a DTensor "
                         f"({p.placements}); apply the expert style before fully_shard and only once")
    dt = distribute_tensor(p.data, mesh, placements, src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _split_args(args, kwargs, what):
    names = ("routed_input", "num_tokens_per_expert")
    vals = list(args[:2])
    for n in names[len(vals):]:
        if n not in kwargs:
            raise TypeError(f"{what}: the wrapped forward takes (routed_input, num_tokens_per_expert); missing {n!r}")
        vals.append(kwargs[n])
    return vals, args[2:], {k: v for k, v in kwargs.items() if k not in names}


class ExpertParallel(ParallelStyle):
    """Shard grouped experts ``Shard(0)`` over a 1-D EP mesh and move tokens to them (torchtitan's contract).

    Tokens are data-parallel across the EP ranks: each rank routes its own tokens; the EP mesh may be
    one mesh dim of a larger mesh (``mesh["ep"]`` of ``("dp", "ep")``) but not a model-parallel mesh dim (one
    named ``tp`` or ``pp`` raises). Raises ``ValueError`` at apply when the number of experts is not
    divisible by the EP degree, and on every rank before the token all_to_all when a rank's
    ``num_tokens_per_expert`` disagrees with its ``routed_input`` rows (or holds negative counts).
    """

    def __init__(self):
        pass

    # the mesh the tokens travel on, and the placements of a 3-D parameter
    def _ep_mesh(self, mesh):
        return mesh

    def _placements(self, name, mesh):
        return [Shard(0)]

    def _check_mesh(self, mesh):
        name = type(self).__name__
        if mesh.ndim != 1:
            raise ValueError(f"{name}: the EP mesh must be 1-D, got a {mesh.ndim}-D mesh {mesh}; slice it, e.g. "
                             f"mesh['ep']")
        _plan.check_ep_dim_names(mesh.mesh_dim_names, name)

    def apply(self, module, device_mesh: DeviceMesh):
        name = type(self).__name__
        mesh = resolve_mesh(device_mesh, name)
        self._check_mesh(mesh)
        ep_mesh = self._ep_mesh(mesh)
        E = _num_experts(module, name)
        _plan.check_num_experts(E, ep_mesh.size(), name)
        for pname, p in list(module.named_parameters(recurse=False)):
            placements = self._placements(pname, mesh) if p.dim() == 3 else [Replicate()] * mesh.ndim
            _distribute(module, pname, mesh, placements, self.src_data_rank)
        group = ep_mesh.get_comm_group(0)
        stack = []

        def pre(mod, args, kwargs):
            (x, counts), rest, kw = _split_args(args, kwargs, name)
            x_local, counts_local, ex = dispatch_sorted(x, counts, group, E, name)
            stack.append(ex)
            return (x_local, counts_local) + tuple(rest), kw

        def post(mod, args, kwargs, out):
            ex = stack.pop()
            if not isinstance(out, torch.Tensor) or isinstance(out, DTensor):
                raise TypeError(f"{name}: the wrapped forward of {type(mod).__name__} must return a plain tensor "
                                f"[T, dim] (use w.to_local() on the DTensor parameters), got {type(out).__name__}")
            return ex.combine(out)

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)
        return module


class ExpertTensorParallel(ExpertParallel):
    """Experts sharded over a 2-D ``("ep", "tp")`` mesh: ``Shard(0)`` on ep, and tensor parallel inside
    each expert on tp (``w1``/``w3`` ``Shard(1)``, column-parallel; ``w2`` ``Shard(2)``, row-parallel), as
    torchtitan's ``ExpertTensorParallel``.

    Tokens move over the ep mesh dim only; every tp rank of an ep rank holds the same tokens. The wrapped
    forward computes with its local pieces, so its output is a partial sum over tp: the enclosing MoE
    module declares it so (torchtitan: ``PrepareModuleInputOutput(..., output_layouts=(Partial(),), ...)``)
    and reduces it together with the shared expert's partial output.
    """

    accepts_nd_mesh = True
    _TP = {"w1": Shard(1), "w3": Shard(1), "w2": Shard(2)}

    def _check_mesh(self, mesh):
        name = type(self).__name__
        if mesh.ndim != 2:
            raise ValueError(f"{name}: needs a 2-D ('ep', 'tp') mesh, got a {mesh.ndim}-D mesh {mesh}")
        names = mesh.mesh_dim_names
        _plan.check_ep_dim_names(names[:1] if names else None, name)

    def _ep_mesh(self, mesh):
        return mesh[mesh.mesh_dim_names[0]] if mesh.mesh_dim_names else mesh[0]

    def _placements(self, name, mesh):
        if name not in self._TP:
            raise ValueError(f"{type(self).__name__}: 3-D parameter {name!r} is not one of w1, w2, w3 (the "
                             f"GroupedExperts contract); the tp sharding of other parameters is not known")
        return [Shard(0), self._TP[name]]
