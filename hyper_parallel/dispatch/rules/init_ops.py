"""``torch.nn.init`` on DTensor parameters, and the ops its functions need that no other family covers.

* ``nn.init.uniform_`` / ``normal_`` / ``constant_`` / ``kaiming_uniform_`` hand
  their tensor to ``__torch_function__`` as a whole (keyword ``tensor=``); they
  are decomposed into the Tensor methods they use (``uniform_``, ``normal_``,
  ``fill_``), which are dispatched like any op. The other ``nn.init``
  functions call Tensor methods themselves. Fans (kaiming, xavier) come from
  the global shape. Random values of sharded parameters come from the
  layout-independent DTensor RNG (``hyper_parallel.manual_seed``), so the gathered
  parameter is the same for every mesh and sharding; replicated parameters get
  torch's own values (``random_ops.py``).
* ``eye_``: ``torch.eye(n, m, out=dt)`` writes each rank's block of the
  identity, no communication (Partial targets raise).
* ``orthogonal_``: the QR factorisation runs replicated (``linalg_qr``, ``qr``,
  ``diag`` are replicated ops: inputs gathered, outputs replicated), then each
  rank copies its block. ``t_`` / ``transpose_`` / ``swapdims_`` /
  ``swapaxes_`` transpose a DTensor in place (its shape and placements swap
  with the dims).
* ``dirac_`` and ``sparse_`` index single elements: they work when the indexed
  dims are unsharded and raise otherwise (``__setitem__``'s rule); ``sparse_``
  also draws ``torch.randperm`` from the process RNG.
"""
from __future__ import annotations

import math
import warnings

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, meta_run, register_decomposition
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt
import torch


# ----------------------------------------------------------------------------- nn.init decompositions
def _fans(shape):
    if len(shape) < 2:
        raise ValueError("Fan in and fan out can not be computed for tensor with fewer than 2 dimensions "
                         f"(DTensor of global shape {tuple(shape)})")
    receptive = 1
    for s in shape[2:]:
        receptive *= s
    return shape[1] * receptive, shape[0] * receptive


def _uniform_(tensor, a=0.0, b=1.0, generator=None):
    with torch.no_grad():
        return tensor.uniform_(a, b, generator=generator)


def _normal_(tensor, mean=0.0, std=1.0, generator=None):
    with torch.no_grad():
        return tensor.normal_(mean, std, generator=generator)


def _constant_(tensor, val):
    with torch.no_grad():
        return tensor.fill_(val)


def _kaiming_uniform_(tensor, a=0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    shape = tuple(tensor.shape)
    if 0 in shape:
        warnings.warn("Initializing zero-element tensors is a no-op", stacklevel=3)
        return tensor
    mode = mode.lower()
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"kaiming_uniform_: mode {mode!r} not supported, please use one of fan_in, fan_out")
    fan_in, fan_out = _fans(shape)
    gain = torch.nn.init.calculate_gain(nonlinearity, a)
    std = gain / math.sqrt(fan_in if mode == "fan_in" else fan_out)
    bound = math.sqrt(3.0) * std  # torch's rounding order: replicated parameters get torch's exact values
    with torch.no_grad():
        return tensor.uniform_(-bound, bound, generator=generator)


# ----------------------------------------------------------------------------- eye(out=)
class EyeOutRule(DistributedOp):
    """``torch.eye(n, m, out=dt)`` (what ``nn.init.eye_`` calls): each rank writes its block of the identity."""

    supports_out = True
    float_args_matter = False

    def strategy(self, call):
        out = call.kwargs.get("out")
        if not _is_dt(out) or len(call.layouts) != 1:
            raise NotImplementedError("eye on DTensors: only torch.eye(n, m, out=dtensor) is supported; create a "
                                      "DTensor identity with distribute_tensor(torch.eye(n, m), mesh, placements)")
        lay, shape = call.layouts[0], tuple(call.shapes[0])
        if lay.has_partial():
            raise RuntimeError(f"eye(out=...): the target DTensor has placements {lay.placements}; a Partial "
                               "target cannot be overwritten in place, call reduce_partial() first")
        want = tuple(meta_run(call.func, call.args, {k: v for k, v in call.kwargs.items() if k != "out"}).shape)
        if want != shape:
            raise ValueError(f"eye(out=...): the target DTensor has global shape {shape} but eye needs {want}; "
                             "a DTensor cannot be resized in place")
        lshape, off = lay.local_shape_and_offset(shape, coord=call.mesh.get_coordinate())
        ops = torch

        def local_fn(*args, out=None, requires_grad=False, **kwargs):
            rows = ops.arange(lshape[0], device=out.device) + off[0]
            cols = ops.arange(lshape[1], device=out.device) + off[1]
            with ops.no_grad():
                out.copy_((rows[:, None] == cols[None, :]).to(out.dtype))
            return out
        return Strategy([lay], lay, local_fn=local_fn, out_shapes=torch.Size(shape))


# ----------------------------------------------------------------------------- replicated linear algebra
class ReplicatedRule(DistributedOp):
    """Ops that need the whole tensor (``linalg_qr``, ``diag``): inputs gathered, outputs replicated.

    An explicit rule (no fallback warning): these are inherently global and small
    (``nn.init.orthogonal_`` factorises a replicated matrix).
    """

    float_args_matter = False

    def strategy(self, call):
        T = torch.Tensor
        ins = [l.replicated() for l in call.layouts]
        out = meta_run(call.func, call.args, call.kwargs)
        base = call.layouts[0]
        if isinstance(out, T):
            outs = base.replicated(out.dim())
        else:
            outs = [base.replicated(o.dim()) if isinstance(o, T) else None for o in out]
        return Strategy(ins, outs)


# ----------------------------------------------------------------------------- in-place transpose
class InplaceTransposeRule(DistributedOp):
    """``t_`` / ``transpose_`` / ``swapdims_`` / ``swapaxes_``: shape and placements swap with the dims."""

    float_args_matter = False

    def strategy(self, call):
        if not call.args or not _is_dt(call.args[0]) or len(call.layouts) != 1:
            raise NotImplementedError(f"{call.name}: the tensor must be a DTensor")
        lay, shape = call.layouts[0], tuple(call.shapes[0])
        nd = len(shape)
        if call.name == "t_":
            if nd > 2:
                raise RuntimeError(f"t_() expects a tensor with <= 2 dimensions, but the DTensor has {nd}")
            d0, d1 = 0, nd - 1 if nd else 0
        else:
            rest = list(call.args[1:])
            d0 = rest[0] if rest else call.kwargs.get("dim0", call.kwargs.get("axis0"))
            d1 = rest[1] if len(rest) > 1 else call.kwargs.get("dim1", call.kwargs.get("axis1"))
            d0, d1 = (d0 % nd, d1 % nd) if nd else (0, 0)
        if nd < 2 or d0 == d1:
            return Strategy([lay], lay, out_shapes=torch.Size(shape))
        perm = list(range(nd))
        perm[d0], perm[d1] = d1, d0
        dm = [lay.dim_map[p] for p in perm]
        out_shape = torch.Size([shape[p] for p in perm])
        return Strategy([lay], lay.with_dim_map(dm, lay.partial), out_shapes=out_shape)


# ----------------------------------------------------------------------------- registration
def register_all():
    init = torch.nn.init
    register_decomposition(init.uniform_, _uniform_)
    register_decomposition(init.normal_, _normal_)
    register_decomposition(init.constant_, _constant_)
    register_decomposition(init.kaiming_uniform_, _kaiming_uniform_)
    EyeOutRule("eye")
    for n in ("linalg_qr", "qr", "diag"):
        ReplicatedRule(n)
    for n in ("t_", "transpose_", "swapdims_", "swapaxes_"):
        InplaceTransposeRule(n)
