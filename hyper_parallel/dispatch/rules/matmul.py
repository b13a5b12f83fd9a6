"""Matmul family (mm, bmm, matmul, linear, addmm, baddbmm, einsum) as einsum sharding.

Every op is described by einsum subscripts for its DTensor operands. On each
mesh dim one of these is chosen:

* ``R``: everything replicated;
* ``S(L)`` for an output letter L: operands holding L shard it, output shards it;
* ``C(L)`` for a contracted letter L present in every operand: output Partial(sum);
* ``P(i)``: operand i Partial(sum), the others replicated: output Partial(sum).

The combination over mesh dims with the fewest bytes to redistribute the
inputs wins (ties: fewer inputs changed, then no Partial output). A bias
operand follows the output (sharded with it, or converted to Partial so it is
added once when the output is Partial).
"""
from __future__ import annotations

import itertools
import string

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, is_local_move, redistribution_cost

UNSHARDABLE = "?"


def _batch_subs(a_batch, b_batch, out_batch_len, letters):
    """Right-aligned batch letters for two operands with broadcasting (size-1 dims unshardable)."""
    a_sub, b_sub, o_sub = [], [], []
    for p in range(out_batch_len):
        L = next(letters)
        ia = p - (out_batch_len - len(a_batch))
        ib = p - (out_batch_len - len(b_batch))
        sa = a_batch[ia] if ia >= 0 else None
        sb = b_batch[ib] if ib >= 0 else None
        size = max(s for s in (sa, sb) if s is not None)
        if sa is not None:
            a_sub.append(L if sa == size else UNSHARDABLE)
        if sb is not None:
            b_sub.append(L if sb == size else UNSHARDABLE)
        o_sub.append(L)
    return "".join(a_sub), "".join(b_sub), "".join(o_sub)


def matmul_subs(shape_a, shape_b):
    """Subscripts for torch.matmul of shapes ``shape_a`` @ ``shape_b``."""
    letters = iter("abcdefgh")
    if len(shape_a) == 1 and len(shape_b) == 1:
        return ["k", "k"], ""
    if len(shape_b) == 1:
        ab, _, ob = _batch_subs(shape_a[:-2], (), len(shape_a) - 2, letters)
        return [ab + "ik", "k"], ob + "i"
    if len(shape_a) == 1:
        _, bb, ob = _batch_subs((), shape_b[:-2], len(shape_b) - 2, letters)
        return ["k", bb + "kj"], ob + "j"
    nb = max(len(shape_a), len(shape_b)) - 2
    ab, bb, ob = _batch_subs(shape_a[:-2], shape_b[:-2], nb, letters)
    return [ab + "ik", bb + "kj"], ob + "ij"


def _bias_subs(bias_shape, out_sub, out_shape):
    """Right-aligned subscripts of a bias broadcast against the output."""
    off = len(out_sub) - len(bias_shape)
    sub = []
    for j, s in enumerate(bias_shape):
        sub.append(out_sub[off + j] if s == out_shape[off + j] else UNSHARDABLE)
    return "".join(sub)


def einsum_strategy(call, in_subs, out_sub, bias_index=None, bias_sub=None, out_shape=None):
    layouts, shapes = call.layouts, call.shapes
    mesh_shape = layouts[0].mesh_shape
    mains = [i for i in range(len(layouts)) if i != bias_index]
    sizes = {}
    for i in mains:
        for L, s in zip(in_subs[i], shapes[i]):
            if L != UNSHARDABLE:
                sizes[L] = s
    out_letters = [L for L in out_sub if L != UNSHARDABLE]
    contracted = [L for L in dict.fromkeys("".join(in_subs[i] for i in mains))
                  if L != UNSHARDABLE and L not in out_sub and all(L in in_subs[i] for i in mains)]
    options = [("R",)] + [("S", L) for L in out_letters] + [("C", L) for L in contracted] + \
              [("P", i) for i in mains]
    per_dim = [[("R",)] if k == 1 else options for k in mesh_shape]
    # Every combination's targets first (cheap); those reached without communication cost 0 and are
    # scored first, so that once a free combination is known the others are only priced (planned) when
    # they could still win the tie-break. The combination index in the key keeps the choice identical to
    # a plain scan in product order, whatever order combinations are priced in.
    cands = []
    for idx, combo in enumerate(itertools.product(*per_dim)):
        targets, out = _einsum_targets(layouts, in_subs, out_sub, bias_index, bias_sub, mesh_shape, mains, combo)
        free = all(t == l or is_local_move(l, t) for l, t in zip(layouts, targets))
        changed = sum(1 for i in range(len(layouts)) if targets[i] != layouts[i])
        cands.append((not free, idx, targets, out, changed, sum(1 for p in out.partial if p)))
    cands.sort(key=lambda c: (c[0], c[4], c[1]))   # free first; then fewer changed inputs (a good bound early)
    best = None
    known = {}   # (input, target) -> bytes: an input's cost priced once, and known costs are added first so
    n_in = len(layouts)   # that a combination already worse than the best is dropped before planning more

    def price(arg_index, target):
        c = known.get((arg_index, target))
        if c is None:
            c = known[(arg_index, target)] = redistribution_cost(layouts[arg_index], target, shapes[arg_index],
                                                                 call.itemsizes[arg_index])
        return c
    for not_free, idx, targets, out, changed, n_partial in cands:
        if best is not None and best[0][0] == 0 and (0, changed, n_partial, idx) >= best[0]:
            continue   # costs are >= 0: cannot beat the best free combination
        cost = 0
        if not_free:
            order = sorted(range(n_in), key=lambda i: (i, targets[i]) not in known)
            for i in order:
                cost += price(i, targets[i])
                if best is not None and cost > best[0][0]:
                    break
        key = (cost, changed, n_partial, idx)
        if best is None or key < best[0]:
            best = (key, targets, out)
    return Strategy(best[1], best[2])


def _einsum_targets(layouts, in_subs, out_sub, bias_index, bias_sub, mesh_shape, mains, combo):
    """Target input layouts and the output layout for one choice per mesh dim (see module docstring)."""
    ins = {i: ([[] for _ in in_subs[i]], [None] * len(mesh_shape)) for i in range(len(layouts))}
    out_dm = [[] for _ in out_sub]
    out_partial = [None] * len(mesh_shape)
    for d, opt in enumerate(combo):
        kind = opt[0]
        if kind == "S":
            L = opt[1]
            for i in range(len(layouts)):
                sub = bias_sub if i == bias_index else in_subs[i]
                if L in sub:
                    ins[i][0][sub.index(L)].append(d)
            out_dm[out_sub.index(L)].append(d)
        elif kind == "C":
            for i in mains:
                ins[i][0][in_subs[i].index(opt[1])].append(d)
            out_partial[d] = "sum"
            if bias_index is not None:
                ins[bias_index][1][d] = "sum"
        elif kind == "P":
            ins[opt[1]][1][d] = "sum"
            out_partial[d] = "sum"
            if bias_index is not None:
                ins[bias_index][1][d] = "sum"
    targets = [layouts[i].with_dim_map(ins[i][0], ins[i][1]) for i in range(len(layouts))]
    return targets, layouts[0].with_dim_map(out_dm, out_partial)


class MatmulRule(DistributedOp):
    """torch.matmul / mm / bmm / mv / dot and their Tensor methods and operators."""

    def __init__(self, op_name, swap=False):
        self.swap = swap
        super().__init__(op_name)

    def strategy(self, call):
        if len(call.layouts) != 2:
            raise NotImplementedError(f"{call.name}: matmul with a plain tensor operand; wrap it as a DTensor")
        s0, s1 = call.shapes
        if self.swap:  # __rmatmul__(self, other) = other @ self
            subs, out = matmul_subs(s1, s0)
            subs = subs[::-1]
        else:
            subs, out = matmul_subs(s0, s1)
        return einsum_strategy(call, subs, out)


class LinearRule(DistributedOp):
    """F.linear(x, w, b): x[..., k] @ w[n, k]^T (+ b[n])."""

    def strategy(self, call):
        nx = len(call.shapes[0])
        letters = string.ascii_lowercase[:max(nx - 1, 0)]
        x_sub = letters + "y"
        w_sub = "zy"
        out_sub = letters + "z"
        subs = [x_sub, w_sub]
        if len(call.layouts) == 3:
            subs.append("z")
            return einsum_strategy(call, subs, out_sub, bias_index=2, bias_sub="z")
        return einsum_strategy(call, subs, out_sub)


class AddmmRule(DistributedOp):
    """addmm(bias, m1, m2) / baddbmm(bias, b1, b2): bias broadcast against the product."""

    def __init__(self, op_name, batched=False):
        self.batched = batched
        super().__init__(op_name)

    def strategy(self, call):
        if len(call.layouts) != 3:
            raise NotImplementedError(f"{call.name}: all three operands must be DTensors")
        if self.batched:
            subs, out = ["bik", "bkj"], "bij"
        else:
            subs, out = ["ik", "kj"], "ij"
        out_shape = tuple(call.shapes[1][:-1]) + (call.shapes[2][-1],)
        bsub = _bias_subs(call.shapes[0], out, out_shape)
        return einsum_strategy(call, [bsub] + subs, out, bias_index=0, bias_sub=bsub)


def parse_einsum(equation, shapes):
    equation = equation.replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    ins = lhs.split(",")
    used = set(equation) - set(".,->")
    free = iter(c for c in string.ascii_letters if c not in used)
    ell = None
    res = []
    for sub, shape in zip(ins, shapes):
        if "..." in sub:
            n = len(shape) - (len(sub) - 3)
            if ell is None or len(ell) < n:
                ell = (ell or "") + "".join(next(free) for _ in range(n - len(ell or "")))
            sub = sub.replace("...", ell[len(ell) - n:] if n else "")
        res.append(sub)
    if not _:
        # implicit output: letters appearing once, sorted
        counts = {}
        for s in res:
            for c in s:
                counts[c] = counts.get(c, 0) + 1
        rhs = (ell or "") + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in (ell or "")))
    elif "..." in rhs:
        rhs = rhs.replace("...", ell or "")
    return res, rhs


class EinsumRule(DistributedOp):
    def strategy(self, call):
        eq = call.args[0]
        if not isinstance(eq, str):
            raise NotImplementedError("einsum: only the equation-string form is supported")
        subs, out = parse_einsum(eq, call.shapes)
        # size-1 broadcast dims cannot be sharded
        sizes = {}
        for sub, sh in zip(subs, call.shapes):
            for c, s in zip(sub, sh):
                sizes[c] = max(sizes.get(c, 1), s)
        subs = ["".join(c if s == sizes[c] else UNSHARDABLE for c, s in zip(sub, sh))
                for sub, sh in zip(subs, call.shapes)]
        return einsum_strategy(call, subs, out)


def register_all():
    for n in ("matmul", "mm", "bmm", "mv", "dot", "inner", "__matmul__", "vdot"):
        MatmulRule(n)
    MatmulRule("__rmatmul__", swap=True)
    LinearRule("linear")
    AddmmRule("addmm")
    AddmmRule("baddbmm", batched=True)
    EinsumRule("einsum")
