"""Optimizer support: ``torch._foreach_*`` and fused optimizer ops, exact ``_foreach_norm``, in-place random init.

Optimizers (SGD, Adam, AdamW...; foreach, for-loop or fused) and ``clip_grad_norm_`` run
unchanged on DTensor parameters: every foreach op is elementwise per list
position, so entry ``i`` of every list is brought to the layout of entry ``i``
of the first list. Norms of sharded tensors are exact: local powered sums are
all-reduced over the sharding mesh dims, one collective per group of tensors
sharded alike. ``normal_``/``uniform_`` draw from the layout-independent RNG so
initialisation does not depend on the parallel layout.
"""
from __future__ import annotations

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, is_inplace
from hyper_parallel.dtensor import random as dt_random
from hyper_parallel.distributed import collectives
from hyper_parallel.dtensor import torch_internals
import torch


def _structure(call):
    """Per top-level arg: list of DTensor indices (for lists) or a single index, in _collect order."""
    from hyper_parallel.dtensor.dtensor import DTensor
    pos = 0
    groups = []
    for a in call.args:
        if isinstance(a, (list, tuple)):
            idx = []
            for x in a:
                if isinstance(x, DTensor):
                    idx.append(pos)
                    pos += 1
                else:
                    idx.append(None)
            groups.append(("list", idx))
        elif isinstance(a, DTensor):
            groups.append(("single", pos))
            pos += 1
        else:
            groups.append(("other", None))
    return groups


class ForeachRule(DistributedOp):
    """Elementwise per list position; the first list's layouts win."""

    def strategy(self, call):
        groups = _structure(call)
        lists = [g[1] for g in groups if g[0] == "list"]
        targets = list(call.layouts)
        base = lists[0]
        for lst in lists[1:]:
            for i, j in enumerate(lst):
                if j is not None and i < len(base) and base[i] is not None:
                    b = call.layouts[base[i]]
                    targets[j] = b if call.shapes[j] == call.shapes[base[i]] else call.layouts[j]
        if is_inplace(call.name):
            return Strategy(targets, None)
        outs = [call.layouts[j] if j is not None else None for j in base]
        shapes = [torch.Size(call.shapes[j]) if j is not None else None for j in base]
        return Strategy(targets, outs, out_shapes=shapes)


class ForeachNormRule(DistributedOp):
    """Per-tensor norms of sharded tensors (0-d replicated results), for any ``ord``, as torch's DTensor.

    Each rank reduces its shard (max / min of ``|x|`` for +-inf; the count of non-zeros for 0; else
    the shard's own norm by torch's kernel, ``vector_norm(shard) ** ord``, as torch's ``_NormPartial``
    does); the partial values of tensors sharded alike are all-reduced together, then ``** (1/ord)``.
    A replicated tensor's norm is torch's ``vector_norm`` of it. Summing ``|x| ** ord`` directly would
    be more accurate in float32 than torch's CPU norm kernel (which accumulates in float32: 2e-5
    relative on a few million elements), but ``clip_grad_norm_`` would then differ from torch's.
    """

    def strategy(self, call):
        groups = _structure(call)
        idx = groups[0][1]  # None for plain (replicated) tensors in the list
        in_layouts = [call.layouts[j].without_partial() for j in idx if j is not None]
        layouts = [call.layouts[j].without_partial() if j is not None else None for j in idx]
        mesh = call.mesh
        ops = torch
        coll = collectives
        sharded = [tuple(sorted(l.sharded_mesh_dims())) if l is not None else () for l in layouts]

        def local_fn(tensors, ord=2, dtype=None):
            # per tensor: a local partial value, combined across shards with `op`, then finished
            p = float(ord)
            inf = float("inf")
            op = "max" if p == inf else "min" if p == -inf else "sum"
            powered = []
            for i, t in enumerate(tensors):
                t = t if dtype is None else t.to(dtype)
                if t.numel() == 0:  # an empty local shard contributes the identity of `op`
                    powered.append(t.new_full((), inf) if op == "min" else t.new_zeros(()))
                elif op == "max":
                    powered.append(t.abs().amax())
                elif op == "min":
                    powered.append(t.abs().amin())
                elif p == 0:  # number of non-zeros
                    powered.append((t != 0).sum().to(t.dtype))
                elif not sharded[i]:  # replicated: the norm itself, nothing to combine
                    powered.append(ops.linalg.vector_norm(t, p))
                else:
                    powered.append(ops.linalg.vector_norm(t, p) ** p)
            by_dims = {}
            for i, dims in enumerate(sharded):
                if dims:
                    by_dims.setdefault(dims, []).append(i)
            for dims, members in by_dims.items():
                buf = ops.stack([powered[i] for i in members])
                for d in dims:
                    buf = coll.all_reduce(buf, mesh.get_comm_group(d), op)
                for k, i in enumerate(members):
                    powered[i] = buf[k]
            if op != "sum" or p == 0:
                return list(powered)
            return [v ** (1.0 / p) if sharded[i] else v for i, v in enumerate(powered)]
        outs = [l.replicated(0) if l is not None else None for l in layouts]
        return Strategy(in_layouts, outs, local_fn=local_fn, out_shapes=[torch.Size(())] * len(layouts))


class RandomInplaceRule(DistributedOp):
    """normal_/uniform_: torch's own on a whole (replicated) tensor, else the layout-independent stream."""

    def strategy(self, call):
        from hyper_parallel.dispatch.rules.random_ops import torch_draws
        whole = torch_draws(call, out_shapes=torch.Size(call.shapes[0]))
        if whole is not None:  # replicated tensor: torch's own normal_ / uniform_
            return whole
        lay = call.layouts[0]
        if lay.has_partial():
            raise RuntimeError(f"{call.name} on a Partial DTensor is ambiguous; call reduce_partial() first")
        if call.kwargs.get("generator") is not None:
            raise NotImplementedError(
                f"{call.name} on a sharded DTensor: generator= is not supported (the draws come from the "
                "layout-independent DTensor random stream; seed it with hyper_parallel.manual_seed). A generator "
                "is used when every rank holds the whole tensor (Replicate placements)")
        shape = call.shapes[0]
        coord = call.mesh.get_coordinate()
        lshape, offset = lay.local_shape_and_offset(shape, coord=coord)
        name = call.name

        def local_fn(tensor, *args, generator=None, **kwargs):
            if name == "normal_":
                mean = args[0] if len(args) > 0 else kwargs.get("mean", 0.0)
                std = args[1] if len(args) > 1 else kwargs.get("std", 1.0)
                z = dt_random.random_local("randn", shape, lshape, offset, tensor.dtype, tensor.device)
                return tensor.copy_(z.mul_(std).add_(mean))
            lo = args[0] if len(args) > 0 else kwargs.get("from", kwargs.get("a", 0.0))
            hi = args[1] if len(args) > 1 else kwargs.get("to", kwargs.get("b", 1.0))
            u = dt_random.random_local("rand", shape, lshape, offset, tensor.dtype, tensor.device)
            return tensor.copy_(u.mul_(hi - lo).add_(lo))
        return Strategy([lay], lay, local_fn=local_fn)


FOREACH_OPS = [
    "_foreach_add", "_foreach_add_", "_foreach_sub", "_foreach_sub_", "_foreach_mul", "_foreach_mul_",
    "_foreach_div", "_foreach_div_", "_foreach_addcmul", "_foreach_addcmul_", "_foreach_addcdiv",
    "_foreach_addcdiv_", "_foreach_lerp", "_foreach_lerp_", "_foreach_sqrt", "_foreach_sqrt_", "_foreach_neg",
    "_foreach_neg_", "_foreach_maximum", "_foreach_maximum_", "_foreach_minimum", "_foreach_minimum_",
    "_foreach_copy_", "_foreach_zero_", "_foreach_abs", "_foreach_abs_", "_foreach_sign", "_foreach_sign_",
    "_foreach_reciprocal", "_foreach_reciprocal_", "_foreach_pow", "_foreach_pow_", "_foreach_clamp_min_",
    "_foreach_clamp_max_", "_foreach_exp", "_foreach_exp_", "_foreach_rsqrt", "_foreach_rsqrt_",
]


class FusedOptimizerRule(ForeachRule):
    """The fused optimizer kernels (Adam/AdamW/SGD/Adagrad with ``fused=True``).

    Elementwise per list position like the foreach ops (the per-parameter step
    counters are plain 0-d tensors). These kernels update parameters and state in
    place *without* bumping the tensors' version counters (torch 2.13), and
    DTensor memoises redistributions per version (``full_tensor()`` after a step
    would return the old values); the local function bumps them. Argument 1, the
    gradients, is only read.
    """

    def strategy(self, call):
        st = super().strategy(call)
        func, bump = call.func, torch_internals.bump_version

        def local_fn(*args, **kwargs):
            out = func(*args, **kwargs)
            for i, a in enumerate(args):
                if i != 1 and isinstance(a, (list, tuple)):
                    for t in a:
                        bump(t)
            return out
        st.local_fn = local_fn
        return st


FUSED_OPTIMIZER_OPS = ["_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"]


def register_all():
    for n in FOREACH_OPS:
        ForeachRule(n)
    for n in FUSED_OPTIMIZER_OPS:
        FusedOptimizerRule(n)
    ForeachNormRule("_foreach_norm")
    RandomInplaceRule("normal_")
    RandomInplaceRule("uniform_")
    from hyper_parallel.dtensor.dtensor import DTensor
    torch_internals.allow_foreach(DTensor)
