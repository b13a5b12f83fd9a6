"""Elementwise ops (unary, binary, ternary, with broadcasting), in place or not.

The output is sharded like one of the inputs (mapped through broadcasting);
the candidate that makes the other inputs cheapest to redistribute wins. Partial
inputs survive only through ops that are linear in them:

* ``add``-like (add, sub, neg...): all DTensor operands Partial(sum) on a mesh
  dim -> output Partial(sum); replicated operands are converted to Partial
  (kept on one rank) so they are counted once. With a scalar operand the
  Partial input is reduced first (as in torch), except in place
  (``p.add_(1.0)``, ``p -= 1``): there the scalar is added on the first rank of
  the partial mesh dims only, so the target stays Partial with no communication.
* ``mul``-like (mul, div numerator): exactly one operand Partial(sum), the
  others replicated -> output Partial(sum).
* everything else: partial inputs are reduced first.

In-place ops keep the layout of their target: a Partial operand of a
non-Partial target is reduced first (``r.mul_(p)`` stays correct), and an op
that would need the target itself redistributed raises, naming the op and the
placements.
"""
from __future__ import annotations

from typing import List

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, is_inplace, redistribution_cost
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt
from hyper_parallel.dtensor.mesh_semantics import semantics_of
import torch

NONLINEAR, ADD, MUL, DIV, UNARY_LINEAR = "nonlinear", "add", "mul", "div", "unary_linear"


def broadcast_shape(shapes):
    n = max((len(s) for s in shapes), default=0)
    out = [1] * n
    for s in shapes:
        off = n - len(s)
        for j, v in enumerate(s):
            o = out[off + j]
            if o == 1:
                out[off + j] = v
            elif v != 1 and v != o:
                raise ValueError(f"shapes {shapes} cannot be broadcast together")
    return tuple(out)


class ElementwiseOp(DistributedOp):
    """Rule for one elementwise op; ``kind`` says how Partial inputs behave."""

    float_args_matter = False

    def __init__(self, op_name: str, kind: str = NONLINEAR):
        self.kind = kind
        self.mesh_semantics_matter = op_name == "clone"   # see strategy: the dispatch cache keys on it
        super().__init__(op_name)

    def strategy(self, call):
        kind = self.kind
        if call.name in _CASTS and not _float_cast(call):
            kind = NONLINEAR   # rounding each Partial piece to an integer/bool is not linear: reduce first
        elif call.name == "clone" and not semantics_of(call.mesh).clone_keeps_partial:
            kind = NONLINEAR   # torch 2.13: clone() of a Partial DTensor is Replicate (contiguous() keeps it)
        return elementwise_strategy(call, kind)


_CASTS = frozenset({"to", "type", "type_as"})


def _float_cast(call) -> bool:
    """Whether a to/type/type_as call gives a floating or complex result (linear in Partial inputs).

    A dtype taken from another DTensor is not part of the dispatch cache key: treated as non-linear.
    """
    if any(_is_dt(a) for a in call.args[1:]) or any(_is_dt(v) for v in call.kwargs.values()):
        return False
    dtypes = [a for a in list(call.args[1:]) + list(call.kwargs.values()) if type(a).__name__ == "dtype"]
    if dtypes:
        return dtypes[-1].is_floating_point or dtypes[-1].is_complex
    if call.name == "to":
        return True   # to(device) / to(memory_format=...): the dtype does not change
    from hyper_parallel.dispatch.rules.base import meta_run
    try:
        out = meta_run(call.func, call.args, call.kwargs)
    except Exception:  # noqa: BLE001 - unusual signatures: be safe
        return False
    if not isinstance(out, torch.Tensor):
        return True   # e.g. x.type() -> a type string: no data is converted
    return out.is_floating_point() or out.is_complex()


def elementwise_strategy(call, kind: str = NONLINEAR) -> Strategy:
    """Strategy for an elementwise op of the given ``kind`` (see module docstring)."""
    layouts, shapes = call.layouts, call.shapes
    n_in = len(layouts)
    out_shape = broadcast_shape(shapes)
    n = len(out_shape)
    offs = [n - len(s) for s in shapes]

    def is_bcast(arg_index, dim):
        return shapes[arg_index][dim] == 1 and out_shape[offs[arg_index] + dim] != 1

    def to_out(arg_index):
        dm = [()] * n
        for j, m in enumerate(layouts[arg_index].dim_map):
            if m and not is_bcast(arg_index, j):
                dm[offs[arg_index] + j] = m
        return tuple(dm)

    inplace = is_inplace(call.name)
    has_scalar_operand = any(
        not _is_dt(a) and a is not None and not isinstance(a, (str, bool)) and _is_number_like(a)
        for a in call.args[1:] if not isinstance(a, (list, tuple)))
    # p.add_(scalar) on a Partial target: add the scalar on one rank only (see module docstring)
    scalar_partial = inplace and kind == ADD and has_scalar_operand and n_in == 1 and len(call.args) == 2 and \
        _is_number_like(call.args[1]) and set(call.kwargs) <= {"alpha"}
    cands: List[tuple] = []
    for i in ([0] if inplace else range(n_in)):
        c = to_out(i)
        if c not in cands:
            cands.append(c)
    mesh_ndim = len(layouts[0].mesh_shape)
    best = None
    for dm in cands:
        used = {d for m in dm for d in m}
        in_partial = [[None] * mesh_ndim for _ in range(n_in)]
        out_partial = [None] * mesh_ndim
        for d in range(mesh_ndim):
            if d in used:
                continue
            ps = {i: layouts[i].partial[d] for i in range(n_in) if layouts[i].partial[d] is not None}
            if not ps:
                continue
            ops = set(ps.values())
            if kind in (ADD, UNARY_LINEAR) and ops == {"sum"} and not (
                    kind == ADD and has_scalar_operand and not scalar_partial):
                out_partial[d] = "sum"
                for i in range(n_in):
                    in_partial[i][d] = "sum"
            elif kind in (MUL, DIV) and ops == {"sum"} and len(ps) == 1 and (
                    kind == MUL or (0 in ps and _is_dt(call.args[0]))):
                out_partial[d] = "sum"
                (i,) = ps
                in_partial[i][d] = "sum"
            if inplace and out_partial[d] != layouts[0].partial[d]:
                # the target keeps its layout: reduce the Partial operands on this mesh dim instead
                out_partial[d] = None
                for i in range(n_in):
                    in_partial[i][d] = None
        targets = []
        for i in range(n_in):
            dmi = []
            for j in range(len(shapes[i])):
                dmi.append(() if is_bcast(i, j) else dm[offs[i] + j])
            targets.append(layouts[i].with_dim_map(dmi, in_partial[i]))
        cost = sum(redistribution_cost(layouts[i], targets[i], shapes[i], call.itemsizes[i]) for i in range(n_in))
        changed = sum(1 for i in range(n_in) if targets[i] != layouts[i])
        key = (cost, changed)
        if best is None or key < best[0]:
            out = layouts[0].with_dim_map(dm, out_partial) if n == len(shapes[0]) else \
                _layout_like(layouts[0], dm, out_partial)
            best = (key, targets, out)
    _, targets, out = best
    if inplace and targets[0] != layouts[0]:
        raise RuntimeError(f"{call.name}: in-place op on a DTensor with placements {layouts[0].placements} would "
                           f"change its layout to {targets[0].placements}; call reduce_partial()/redistribute() "
                           "first or use the out-of-place op")
    local_fn = None
    if scalar_partial and out.has_partial():
        local_fn = _scalar_on_root(call, [d for d, p in enumerate(out.partial) if p is not None])
    # the output shape is the broadcast shape (no meta run on a cache miss); casts with a DTensor dtype
    # source (type_as) take their own shape: leave those to the meta run
    out_shapes = None
    if call.name not in _CASTS:
        out_shapes = torch.Size(out_shape)
    return Strategy(targets, out, local_fn=local_fn, out_shapes=out_shapes)


def _scalar_on_root(call, partial_dims):
    """Local ``x.op_(scalar)`` adding the scalar only where the coordinate on every Partial mesh dim is 0."""
    func = call.func
    coord = call.mesh.get_coordinate()
    if all(coord[d] == 0 for d in partial_dims):
        return None  # this rank applies the op as is
    T = torch.Tensor

    def local_fn(local, other, **kwargs):
        zero = torch.zeros_like(other) if isinstance(other, T) else type(other)(0)
        return func(local, zero, **kwargs)
    return local_fn


def _layout_like(base, dim_map, partial):
    return base.with_dim_map(dim_map, partial)


def _is_number_like(arg):
    if isinstance(arg, (int, float, complex)):
        return True
    T = torch.Tensor
    return isinstance(arg, T) and not _is_dt(arg) and arg.dim() == 0


# op families -----------------------------------------------------------------------------
ADD_OPS = ["add", "sub", "rsub", "__add__", "__radd__", "__sub__", "__rsub__", "__iadd__", "__isub__", "add_",
           "sub_", "subtract"]
UNARY_LINEAR_OPS = ["neg", "negative", "__neg__", "neg_", "positive", "clone", "contiguous", "to", "float",
                    "double", "half", "bfloat16", "type_as", "type", "real", "conj", "resolve_conj", "resolve_neg",
                    "__pos__", "requires_grad_", "zero_"]
MUL_OPS = ["mul", "__mul__", "__rmul__", "mul_", "__imul__", "multiply"]
DIV_OPS = ["div", "__div__", "__idiv__", "__truediv__", "div_", "__itruediv__", "true_divide", "divide"]
NONLINEAR_OPS = [
    # activations & math
    "relu", "relu_", "gelu", "silu", "silu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "softplus", "elu", "leaky_relu",
    "hardtanh", "relu6", "mish", "exp", "exp_", "expm1", "log", "log_", "log1p", "log2", "log10", "sqrt", "sqrt_",
    "rsqrt", "rsqrt_", "abs", "abs_", "sin", "cos", "tan", "erf", "erfinv", "sign", "sgn", "floor", "ceil", "round",
    "trunc", "frac", "reciprocal", "reciprocal_", "square", "pow", "pow_", "__pow__", "__rpow__", "__ipow__",
    "float_power", "__rtruediv__", "__rdiv__", "__abs__", "__rmod__", "__rand__", "__ror__", "__rxor__", "__floordiv__", "__rfloordiv__", "floor_divide", "remainder", "__mod__", "fmod",
    "clamp", "clamp_", "clip", "clamp_min", "clamp_max", "clamp_min_", "clamp_max_", "nan_to_num", "logit",
    "sigmoid", "atan", "asin", "acos", "sinh", "cosh", "atan2", "hypot", "lerp", "lerp_", "addcmul", "addcmul_",
    "addcdiv", "addcdiv_", "maximum", "minimum", "fmax", "fmin", "where", "masked_fill", "masked_fill_",
    "copy_", "fill_", "isnan", "isinf", "isfinite", "logical_not", "logical_and", "logical_or", "logical_xor",
    "bitwise_not", "bitwise_and", "bitwise_or", "__and__", "__or__", "__xor__", "__invert__",
    "eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "greater", "less", "greater_equal", "less_equal", "not_equal", "equal_elementwise", "bool", "long", "int",
    "short", "char", "byte", "heaviside", "xlogy", "sigmoid_", "threshold", "hardsigmoid", "hardswish", "selu",
    "celu", "softsign", "erfinv_", "sign_", "floor_", "ceil_", "round_", "trunc_", "square_", "tanhshrink", "logsigmoid", "exp2", "sinc", "deg2rad", "rad2deg", "angle", "mul_scalar",
]


def register_all():
    for n in ADD_OPS:
        ElementwiseOp(n, ADD)
    for n in UNARY_LINEAR_OPS:
        ElementwiseOp(n, UNARY_LINEAR)
    for n in MUL_OPS:
        ElementwiseOp(n, MUL)
    for n in DIV_OPS:
        ElementwiseOp(n, DIV)
    for n in NONLINEAR_OPS:
        ElementwiseOp(n, NONLINEAR)
