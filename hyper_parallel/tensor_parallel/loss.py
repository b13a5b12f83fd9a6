"""loss_parallel: cross-entropy on logits sharded over the class dimension.

Inside ``with loss_parallel():``, ``F.cross_entropy(logits, target)`` with
``logits`` a DTensor sharded on its class (last) dim computes the loss without
gathering the vocabulary: per rank, the local max, sum of exponentials and the
target logit (if the target falls in the local shard) are combined with three
small all_reduces of [N] values; the backward is ``softmax - onehot`` on each
rank's own shard, with no communication.

The target holds class indices ([N], an integer tensor). It may be a DTensor
laid out like the logits' batch dim (replicated over the class-sharding mesh
dim), or - as in PyTorch - a plain tensor when the logits' batch dim is not
sharded: every rank then passes the same full target, which is treated as
replicated (``DTensor.from_local(target, mesh, [Replicate()] * mesh.ndim)``, no
communication). A plain target with batch-sharded logits is ambiguous (full or
local?) and raises ``ValueError``; wrap it with ``DTensor.from_local`` yourself.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from hyper_parallel.dtensor.dtensor import DTensor, register_special, unregister_special
from hyper_parallel.dtensor.placement_types import Replicate
from hyper_parallel.dispatch import dispatcher
from hyper_parallel.dispatch.rules import base as _base
from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy
from hyper_parallel.distributed import collectives
import torch



class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, ignore_index):
        coll = collectives
        # half-precision logits are computed in float32 (as torch's loss_parallel); float32 and
        # float64 keep their own precision (a float64 program must not be rounded to float32)
        x = logits if logits.element_size() >= 4 else logits.float()
        local_max = x.max(dim=-1).values
        gmax = coll.all_reduce(local_max, group, "max")
        shifted = x - gmax.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = coll.all_reduce(exp.sum(dim=-1), group, "sum")
        n_local = x.shape[-1]
        local_t = target - vocab_start
        in_shard = (local_t >= 0) & (local_t < n_local) & (target != ignore_index)
        safe = local_t.clamp(0, max(n_local - 1, 0))
        picked = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * in_shard
        tgt_logit = coll.all_reduce(picked, group, "sum")
        loss = sum_exp.log() - tgt_logit
        valid = target != ignore_index
        loss = loss * valid
        ctx.save_for_backward(exp, sum_exp, safe, in_shard, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        exp, sum_exp, safe, in_shard, valid = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)
        onehot = torch.zeros_like(grad).scatter_(-1, safe.unsqueeze(-1), in_shard.unsqueeze(-1).to(grad.dtype))
        grad = (grad - onehot) * (grad_output * valid).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None


class _LossParallelCE(DistributedOp):
    """cross_entropy with class-sharded logits [N, C] / [N, C]-flattenable, target replicated or batch-sharded."""

    def __init__(self, op_name, previous):
        self.previous = previous
        # not registered here: loss_parallel installs it with base.override (undone on exit)
        super().__init__(op_name, register=False)

    def strategy(self, call):
        lay = call.layouts[0]
        shape = call.shapes[0]
        ndim = len(shape)
        cdim = ndim - 1
        if not lay.dim_map[cdim]:
            if self.previous is None:
                raise NotImplementedError("cross_entropy: logits are not sharded on the class dim")
            return self.previous.strategy(call)
        if len(lay.dim_map[cdim]) != 1 or ndim != 2:
            raise NotImplementedError(f"loss_parallel: logits must be 2-D [N, C] with the class dim sharded on one "
                                      f"mesh dim, got shape {shape} with {lay.placements}; flatten first")
        md = lay.dim_map[cdim][0]
        mesh = call.mesh
        group = mesh.get_comm_group(md)
        coord = mesh.get_coordinate()
        _, offset = lay.local_shape_and_offset(shape, coord=coord)
        vocab_start = offset[cdim]
        kwargs = call.kwargs
        reduction = kwargs.get("reduction", "mean")
        ignore_index = kwargs.get("ignore_index", -100)
        if kwargs.get("label_smoothing", 0.0) or kwargs.get("weight") is not None:
            raise NotImplementedError("loss_parallel: weight and label_smoothing are not supported")
        tgt_layout = call.layouts[1] if len(call.layouts) > 1 else None
        if tgt_layout is not None and len(call.shapes[1]) != 1:
            raise NotImplementedError(f"loss_parallel: target must hold class indices of shape [N] = [{shape[0]}], "
                                      f"got shape {tuple(call.shapes[1])} (class probabilities are not supported)")
        # target must be laid out like the logits' batch dim, replicated on the class mesh dim
        batch_dm = lay.dim_map[0]
        tgt_target = tgt_layout.with_dim_map([batch_dm], (None,) * len(lay.mesh_shape)) if tgt_layout else None
        n_total = shape[0]

        def local_fn(logits, target, *args, **kwargs):
            loss = _VocabParallelCE.apply(logits, target, group, vocab_start, ignore_index)
            if reduction == "none":
                return loss
            if reduction == "sum":
                return loss.sum()
            valid = (target != ignore_index).sum()
            count = valid
            for d in batch_dm:
                count = collectives.all_reduce(count, mesh.get_comm_group(d), "sum")
            return loss.sum() / count.clamp(min=1)
        if reduction == "none":
            out = lay.with_dim_map([batch_dm], (None,) * len(lay.mesh_shape))
            out_shape = torch.Size((n_total,))
        else:
            partial = ["sum" if d in batch_dm else None for d in range(len(lay.mesh_shape))]
            out = lay.with_dim_map([], partial)
            out_shape = torch.Size(())
        ins = [lay] + ([tgt_target] if tgt_layout else [])
        return Strategy(ins, out, local_fn=local_fn, out_shapes=out_shape)


def _is_class_sharded(logits) -> bool:
    return isinstance(logits, DTensor) and logits.dim() >= 1 and bool(logits._layout._dims()[-1])


_tls = threading.local()


def _cross_entropy_plain_target(input, target=None, *args, **kwargs):
    """``F.cross_entropy`` inside ``loss_parallel()``: accept a plain class-index target (see module doc)."""
    if getattr(_tls, "active", False):
        # re-entered from the op handler below: go straight to the rule-based dispatch
        call_args = (input,) + args if target is None else (input, target) + args
        return dispatcher.dispatch(torch.nn.functional.cross_entropy, call_args, kwargs)
    in_kwargs = target is None and "target" in kwargs
    if in_kwargs:
        target = kwargs["target"]
    if _is_class_sharded(input) and isinstance(target, torch.Tensor) and not isinstance(target, DTensor):
        lay, shape = input._layout, tuple(input.shape)
        if lay.dim_map[0]:
            raise ValueError(
                f"loss_parallel: target is a plain tensor but the logits' batch dim is sharded "
                f"(logits placements {lay.placements}); pass the target as a DTensor "
                "(DTensor.from_local(local_target, mesh, placements)) so that its layout is explicit")
        if target.dim() != 1 or target.shape[0] != shape[0] or target.is_floating_point() or target.is_complex():
            raise ValueError(
                f"loss_parallel: target must be an integer tensor of class indices of shape ({shape[0]},) "
                f"matching logits of shape {shape}, got {target.dtype} of shape {tuple(target.shape)}")
        target = DTensor.from_local(target, input.device_mesh, [Replicate()] * input.device_mesh.ndim)
    if in_kwargs:
        kwargs = dict(kwargs, target=target)
        call_args = (input,) + args
    else:
        call_args = (input, target) + args
    # through the regular handler, so that SkipDTensorDispatch and friends still apply
    _tls.active = True
    try:
        return dispatcher.handle(torch.nn.functional.cross_entropy, call_args, kwargs)
    finally:
        _tls.active = False


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Within this context, ``F.cross_entropy`` on class-sharded DTensor logits stays sharded.

    ``logits`` must be a 2-D DTensor [N, C] sharded on C over one mesh dim
    (flatten [B, S, C] first). ``target`` ([N] class indices) is a DTensor laid out
    like the logits' batch dim, or a plain integer tensor when that dim is not
    sharded (then every rank passes the same full target; treated as replicated).
    ``reduction`` mean/sum/none and ``ignore_index`` are supported; ``weight`` and
    ``label_smoothing`` are not. Forward: three all_reduces of [N] values; backward:
    no communication.
    """
    prev = _base.get_rule("cross_entropy")
    ce = torch.nn.functional.cross_entropy
    with _base.override("cross_entropy", _LossParallelCE("cross_entropy", prev)):
        prev_special = register_special(ce, _cross_entropy_plain_target)
        try:
            yield
        finally:
            unregister_special(ce, prev_special)
