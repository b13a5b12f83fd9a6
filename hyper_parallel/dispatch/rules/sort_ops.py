"""Sorting and sampling: sort, argsort, msort, topk, kthvalue, multinomial.

* ``sort`` / ``argsort`` / ``msort`` / ``topk`` / ``kthvalue``: the sorted dim
  is unsharded (so indices are global), every other dim keeps its shard;
  Partial inputs are reduced first. Values and indices share the layout.
* ``multinomial(input[, C] or [N, C], num_samples, replacement)``: the class
  dim is unsharded, the row dim keeps its shard. Samples are drawn from the
  layout-independent DTensor random stream (the same draws whatever the mesh
  and placements, identical on replicas): inverse-CDF sampling with
  replacement, weighted keys ``u ** (1 / p)`` (top-``num_samples``) without.
  They follow the requested distribution but are not ``torch.multinomial``'s
  draws for the same seed. Replicated probabilities (every rank holds them
  whole) get ``torch.multinomial`` itself: one process's draws (``random_ops.py``).
"""
from __future__ import annotations

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, unshard_dims
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt, bind_args as _bind
import torch

_SORT_NAMES = {
    "sort": (("input", "dim", "descending"), -1, 2),
    "argsort": (("input", "dim", "descending"), -1, 1),
    "msort": (("input",), 0, 1),
    "topk": (("input", "k", "dim", "largest", "sorted"), -1, 2),
    "kthvalue": (("input", "k", "dim", "keepdim"), -1, 2),
}


class SortRule(DistributedOp):
    """sort / argsort / msort / topk / kthvalue: the dim it works along is unsharded."""

    float_args_matter = False

    def strategy(self, call):
        names, default_dim, n_out = _SORT_NAMES[call.name]
        if not call.args or not _is_dt(call.args[0]):
            raise NotImplementedError(f"{call.name}: the input must be a DTensor")
        v = _bind(call.args, call.kwargs, names)
        lay, shape = call.layouts[0], call.shapes[0]
        nd = len(shape)
        dim = (v.get("dim", default_dim) if v.get("dim") is not None else default_dim) % nd if nd else 0
        tgt = unshard_dims(lay, [dim]) if nd else lay
        tgt = tgt.without_partial() if tgt.has_partial() else tgt
        out = tgt
        if call.name == "kthvalue" and not v.get("keepdim", False) and nd:
            out = tgt.with_dim_map([m for t, m in enumerate(tgt.dim_map) if t != dim], tgt.partial)
        return Strategy([tgt] + [l.replicated() for l in call.layouts[1:]], (out, out) if n_out == 2 else out)


class MultinomialRule(DistributedOp):
    """multinomial: rows keep their shard; layout-independent draws (see module docstring)."""

    float_args_matter = False

    def strategy(self, call):
        v = _bind(call.args, call.kwargs, ("input", "num_samples", "replacement"))
        if not _is_dt(v.get("input")):
            raise NotImplementedError("multinomial: the input must be a DTensor")
        shape = call.shapes[0]
        if len(shape) in (1, 2):
            from hyper_parallel.dispatch.rules.random_ops import torch_draws
            ns = int(v["num_samples"])
            whole = torch_draws(call, out_shapes=torch.Size(tuple(shape[:-1]) + (ns,)))
            if whole is not None:  # replicated probabilities: torch.multinomial's own draws
                return whole
        if v.get("generator") is not None:
            raise NotImplementedError("multinomial on a DTensor: a generator is not supported (the draws come from "
                                      "the DTensor random stream; seed it with hyper_parallel.manual_seed)")
        lay, shape = call.layouts[0], call.shapes[0]
        nd = len(shape)
        if nd not in (1, 2):
            raise ValueError(f"multinomial: input must be 1-d or 2-d, got shape {tuple(shape)}")
        tgt = unshard_dims(lay, [nd - 1]).without_partial()
        ns = int(v["num_samples"])
        replacement = bool(v.get("replacement", False))
        out_shape = (ns,) if nd == 1 else (shape[0], ns)
        out = tgt  # same dim map: rows keep the shard, the sample dim is unsharded
        lshape, offset = out.local_shape_and_offset(out_shape, coord=call.mesh.get_coordinate())
        n_classes = shape[-1]
        return Strategy([tgt], out, local_fn=_sampler(ns, replacement, out_shape, lshape, offset, n_classes),
                        out_shapes=torch.Size(out_shape))


def _sampler(num_samples, replacement, out_shape, lshape, offset, n_classes):
    ops = torch

    def local_fn(local, *args, **kwargs):
        from hyper_parallel.dtensor.random import random_local
        p = local.detach().double()
        rows = p if p.dim() == 2 else p.unsqueeze(0)
        if replacement:
            u = random_local("rand", out_shape, lshape, offset, ops.float64, local.device)
            u = u if u.dim() == 2 else u.unsqueeze(0)
            cdf = rows.cumsum(-1)
            cdf = cdf / cdf[:, -1:].clamp_min(1e-300)
            idx = ops.searchsorted(cdf, u.contiguous(), right=True).clamp_max(n_classes - 1)
        else:
            if num_samples > n_classes:
                raise RuntimeError(f"multinomial: cannot sample num_samples={num_samples} > {n_classes} classes without "
                                   "replacement")
            gshape = out_shape[:-1] + (n_classes,)
            u = random_local("rand", gshape, lshape[:-1] + (n_classes,), offset[:-1] + (0,), ops.float64, local.device)
            u = u if u.dim() == 2 else u.unsqueeze(0)
            keys = ops.where(rows > 0, u.clamp_min(1e-300).log() / rows, ops.full_like(rows, float("-inf")))
            idx = keys.topk(num_samples, dim=-1).indices if rows.shape[0] else ops.zeros(0, num_samples, dtype=ops.long)
        idx = idx.to(ops.long)
        return idx if local.dim() == 2 else idx.squeeze(0)
    return local_fn


def register_all():
    for n in _SORT_NAMES:
        SortRule(n)
    MultinomialRule("multinomial")


__all__ = ["register_all", "SortRule", "MultinomialRule"]
