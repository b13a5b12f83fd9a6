"""The property-based sweep's cases and their per-rank check (no hypothesis here: workers import this).

A :class:`Case` is plain, picklable data: an op of the catalog ``OPS`` with its arguments, a mesh
shape, and per input its global shape, kind and placements spec. ``tests/dispatch/test_property_sweep.py``
draws cases with hypothesis in the pytest process; every rank of a worker pool runs
:func:`check_case` on the same case. The check builds the inputs from the case's seed (identical on
every rank), lays them out as the spec says (``Partial`` pieces whose reduction is the value, for
each reduce op), runs the op on DTensors and on the full tensors in one process (float64), and
compares every output's values and every DTensor input's gradient at 1e-10.

Spec spellings (``Case.inputs[i][2]``):

* ``None``                                   a plain tensor (index inputs only: replicated)
* ``("obj", ("S0", "R", "P:max"))``          placement objects, one per mesh dim
* ``("alias", ("dp", ("tp", "pp"), "None"))`` alias names, one per tensor dim (tuples: several mesh
  dims over one tensor dim, first name outermost)

Input kinds: ``"f"`` a float64 tensor (randn), ``("i", high)`` int64 indices in ``[0, high)``,
``("u", dim, high)`` indices unique along ``dim`` (for ``scatter``, whose duplicates are undefined).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard

DT = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)
MESH_NAMES = {1: ("tp",), 2: ("dp", "tp"), 3: ("pp", "dp", "tp")}


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    args: tuple
    mesh: tuple
    inputs: tuple          # ((shape, kind, spec), ...)
    seed: int = 0
    warm: bool = True      # a first call on copies: the checked call is a dispatch-cache hit
    loss: str = "full"     # "full": backward through full_tensor(); "dtensor": DTensor loss, DTensor grad

    def __repr__(self):
        ins = ", ".join(f"({s!r}, {k!r}, {sp!r})" for s, k, sp in self.inputs)
        return (f"Case(op={self.op!r}, args={self.args!r}, mesh={self.mesh!r}, inputs=({ins},), "
                f"seed={self.seed}, warm={self.warm}, loss={self.loss!r})")


# ----------------------------------------------------------------------------- placements

def parse_placement(tok: str):
    if tok == "R":
        return Replicate()
    if tok.startswith("S"):
        return Shard(int(tok[1:]))
    if tok.startswith("P:"):
        return Partial(tok[2:])
    raise ValueError(f"bad placement token {tok!r}")


def spec_placements(spec):
    """The ``placements`` argument the library gets for ``spec`` (objects or alias names)."""
    kind, body = spec
    if kind == "obj":
        return [parse_placement(t) for t in body]
    return tuple(body)


def partial_info(spec):
    """(mesh dims that are Partial, reduce op) of an object spec."""
    if spec is None or spec[0] != "obj":
        return [], None
    dims = [d for d, t in enumerate(spec[1]) if t.startswith("P:")]
    ops = {spec[1][d][2:] for d in dims}
    assert len(ops) <= 1, spec
    return dims, (ops.pop() if ops else None)


def _partial_piece(full, n, idx, op):
    """Piece ``idx`` of ``n`` whose ``op``-reduction over all pieces is ``full``."""
    noise = (torch.arange(full.numel()) % 3 + 1).reshape(full.shape).to(full.dtype)
    owner = (torch.arange(full.numel()) % n).reshape(full.shape)
    z = noise * (idx - (n - 1) / 2)   # sums to zero over the pieces
    if op == "sum":
        return (full if idx == 0 else torch.zeros_like(full)) + z
    if op == "avg":
        return full + z
    if op == "max":
        return full - (owner != idx).to(full.dtype) * (1 + idx)
    if op == "min":
        return full + (owner != idx).to(full.dtype) * (1 + idx)
    raise ValueError(op)


def make_dtensor(full, mesh, spec, requires_grad):
    """(DTensor laid out as ``spec``, local leaf or None, expected-gradient factor or None).

    Inputs Partial with avg/max/min enter through a local leaf (``from_local`` of this rank's piece):
    the gradient that is defined for them is each piece's (``W / n`` for avg, ``W`` on the piece that
    holds the max/min), which the returned factor maps the one-process gradient to. A leaf DTensor with
    those placements gets the full gradient, ``Replicate``, as in PyTorch (tested in
    ``tests/dispatch/test_sweep_regressions.py``). Every other input is a leaf DTensor.
    """
    placements = spec_placements(spec)
    pdims, op = partial_info(spec)
    if not pdims:
        d = hp.distribute_tensor(full.detach(), mesh, placements, src_data_rank=None)
        return (d.requires_grad_() if requires_grad else d), None, None
    coord = mesh.get_coordinate()
    n, idx = 1, 0
    for md in pdims:
        n *= mesh.size(md)
        idx = idx * mesh.size(md) + coord[md]
    piece = _partial_piece(full.detach(), n, idx, op)
    base = [Replicate() if isinstance(p, Partial) else p for p in placements]
    local = hp.distribute_tensor(piece, mesh, base, src_data_rank=None).to_local().detach().clone()
    if op == "sum" or not requires_grad:
        d = hp.DTensor.from_local(local, mesh, placements, shape=tuple(full.shape), stride=full.stride())
        return (d.requires_grad_() if requires_grad else d), None, None
    local.requires_grad_()
    d = hp.DTensor.from_local(local, mesh, placements, shape=tuple(full.shape), stride=full.stride())
    if op == "avg":
        factor = torch.full_like(full, 1.0 / n)
    else:
        owner = (torch.arange(full.numel()) % n).reshape(full.shape)
        factor = (owner == idx).to(full.dtype)
    return d, local, (factor, base)


# ----------------------------------------------------------------------------- inputs

def make_inputs(case):
    g = torch.Generator().manual_seed(case.seed)
    out = []
    for shape, kind, _ in case.inputs:
        if kind == "f":
            out.append(torch.randn(shape, generator=g, dtype=DT))
        elif kind[0] == "i":
            out.append(torch.randint(0, kind[1], shape, generator=g, dtype=torch.int64))
        elif kind[0] == "u":
            dim, high = kind[1], kind[2]
            big = list(shape)
            big[dim] = high
            perm = torch.rand(big, generator=g).argsort(dim=dim)
            out.append(perm.narrow(dim, 0, shape[dim]).contiguous())
        else:
            raise ValueError(kind)
    return out


# ----------------------------------------------------------------------------- the op catalog
# name -> (family, builder(args) -> fn(*tensors) -> tensor or tuple of tensors)

_UNARY = {
    "gelu": F.gelu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu, "exp": torch.exp,
    "sin": torch.sin, "square": torch.square, "abs": torch.abs, "relu": torch.relu, "softplus": F.softplus,
    "neg": torch.neg, "clamp": lambda x: x.clamp(-0.5, 0.7), "rsqrt": lambda x: (x * x + 0.5).rsqrt(),
    "scalar_affine": lambda x: x * 2.5 + 1.0, "rsub": lambda x: 3.0 - x, "pow_scalar": lambda x: x ** 2,
    "erf": torch.erf, "log1p_sq": lambda x: torch.log1p(x * x),
}

_BINARY = {
    "add": torch.add, "mul": torch.mul, "sub": lambda x, y: y - x, "div": lambda x, y: x / (y * y + 1),
    "maximum": torch.maximum, "minimum": torch.minimum, "where": lambda x, y: torch.where(x > 0, x, y),
    "atan2": torch.atan2, "lerp": lambda x, y: torch.lerp(x, y, 0.3), "hypot": torch.hypot,
    "add_alpha": lambda x, y: torch.add(x, y, alpha=-2.0),
}


def _reduce(args):
    fname, dim, keepdim = args
    kw = {} if dim is None else dict(dim=dim, keepdim=keepdim)
    fns = {
        "sum": lambda x: x.sum(**kw), "mean": lambda x: x.mean(**kw), "amax": lambda x: x.amax(**kw),
        "amin": lambda x: x.amin(**kw), "prod": lambda x: x.prod(**kw),
        "logsumexp": lambda x: torch.logsumexp(x, dim if dim is not None else tuple(range(x.dim())),
                                               keepdim=keepdim),
        "var": lambda x: x.var(**kw), "std": lambda x: x.std(**kw),
        "norm2": lambda x: torch.linalg.vector_norm(x, 2, **kw), "norm3": lambda x: torch.linalg.vector_norm(x, 3, **kw),
        "norminf": lambda x: torch.linalg.vector_norm(x, float("inf"), **kw),
        "max_all": lambda x: x.max(), "min_all": lambda x: x.min(), "nansum": lambda x: x.nansum(**kw),
    }
    return fns[fname]


def _max_dim(args):
    fname, dim, keepdim = args
    return lambda x: tuple(getattr(x, fname)(dim, keepdim=keepdim))


def _argmax(args):
    fname, dim, keepdim = args
    return lambda x: getattr(x, fname)(dim=dim, keepdim=keepdim)


def _reshape(args):
    method, out_shape = args
    return lambda x: getattr(x, method)(out_shape)


def _view_op(args):
    name, p = args
    fns = {
        "transpose": lambda x: x.transpose(*p), "permute": lambda x: x.permute(*p),
        "unsqueeze": lambda x: x.unsqueeze(p), "squeeze": lambda x: x.squeeze(p),
        "flatten": lambda x: x.flatten(*p), "unflatten": lambda x: x.unflatten(*p),
        "expand": lambda x: x.expand(*p), "movedim": lambda x: x.movedim(*p),
        "narrow": lambda x: x.narrow(*p), "select": lambda x: x.select(*p),
        "slice": lambda x: x[(slice(None),) * p[0] + (slice(p[1], p[2], p[3]),)],
        "repeat": lambda x: x.repeat(*p), "flip": lambda x: x.flip(p), "roll": lambda x: x.roll(*p),
        "tril": lambda x: x.tril(p), "triu": lambda x: x.triu(p), "t": lambda x: x.t(),
        "transpose_reshape": lambda x: x.transpose(0, -1).contiguous().reshape(-1),
        "split": lambda x: tuple(x.split(*p)), "chunk": lambda x: tuple(x.chunk(*p)),
        "unbind": lambda x: tuple(x.unbind(p)),
    }
    return fns[name]


def _cat(args):
    name, dim = args
    if name == "cat":
        return lambda *xs: torch.cat(xs, dim)
    return lambda *xs: torch.stack(xs, dim)


def _matmul(args):
    name = args[0]
    fns = {
        "matmul": torch.matmul, "mm": torch.mm, "bmm": torch.bmm, "mv": torch.mv, "dot": torch.dot,
        "outer": torch.outer, "linear": F.linear,
        "addmm": lambda c, a, b: torch.addmm(c, a, b, beta=args[1], alpha=args[2]),
        "baddbmm": lambda c, a, b: torch.baddbmm(c, a, b, beta=args[1], alpha=args[2]),
        "einsum": lambda *xs: torch.einsum(args[1], *xs),
    }
    return fns[name]


def _indexing(args):
    name = args[0]
    p = args[1:]
    fns = {
        "index_select": lambda x, i: torch.index_select(x, p[0], i),
        "gather": lambda x, i: torch.gather(x, p[0], i),
        "scatter": lambda x, i, s: x.scatter(p[0], i, s),
        "scatter_add": lambda x, i, s: x.scatter_add(p[0], i, s),
        "scatter_reduce": lambda x, i, s: x.scatter_reduce(p[0], i, s, p[1], include_self=p[2]),
        "index_add": lambda x, i, s: x.index_add(p[0], i, s, alpha=1.5),
        "getitem_idx": lambda x, i: x[(slice(None),) * p[0] + (i,)],
        "masked_fill": lambda x: x.masked_fill(x > 0.3, -1.0),
        "embedding": lambda i, w: F.embedding(i, w),
        "setitem_slice": _setitem_slice(p),
    }
    return fns[name]


def _setitem_slice(p):
    def f(x, v):
        y = x * 1.0
        y[(slice(None),) * p[0] + (slice(p[1], p[2]),)] = v * 2.0
        return y
    return f


def _norm(args):
    name = args[0]
    p = args[1:]
    fns = {
        "softmax": lambda x: torch.softmax(x, p[0]), "log_softmax": lambda x: F.log_softmax(x, p[0]),
        "softmin": lambda x: F.softmin(x, p[0]),
        "layer_norm": lambda x, *wb: F.layer_norm(x, p[0], *wb, eps=1e-5),
        "rms_norm": lambda x, *w: F.rms_norm(x, p[0], *w, eps=1e-6),
        "normalize": lambda x: F.normalize(x, 2.0, p[0]),
        "cross_entropy": lambda x, t: F.cross_entropy(x, t, reduction=p[0], label_smoothing=p[1]),
        "nll_loss": lambda x, t: F.nll_loss(F.log_softmax(x, 1), t, reduction=p[0]),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=p[0]),
    }
    return fns[name]


def _sort(args):
    name = args[0]
    p = args[1:]
    fns = {
        "sort": lambda x: tuple(torch.sort(x, dim=p[0], descending=p[1])),
        "topk": lambda x: tuple(torch.topk(x, p[0], dim=p[1], largest=p[2])),
        "kthvalue": lambda x: tuple(torch.kthvalue(x, p[0], dim=p[1], keepdim=p[2])),
        "argsort": lambda x: torch.argsort(x, dim=p[0], descending=p[1]),
    }
    return fns[name]


def _scan(args):
    name, dim = args
    if name in ("cummax", "cummin"):
        return lambda x: tuple(getattr(torch, name)(x, dim))
    return lambda x: getattr(torch, name)(x, dim)


FAMILIES = {
    "unary": ("elementwise", lambda a: _UNARY[a[0]]),
    "binary": ("elementwise", lambda a: _BINARY[a[0]]),
    "addcmul": ("elementwise", lambda a: lambda x, y, z: torch.addcmul(x, y, z, value=0.5)),
    "reduce": ("reduction", _reduce),
    "max_dim": ("reduction", _max_dim),
    "argmax": ("reduction", _argmax),
    "reshape": ("view", _reshape),
    "view_op": ("view", _view_op),
    "cat": ("view", _cat),
    "matmul": ("matmul", _matmul),
    "indexing": ("indexing", _indexing),
    "norm": ("softmax_norm", _norm),
    "sort": ("sort_topk", _sort),
    "scan": ("cumulative", _scan),
}


def op_fn(case):
    return FAMILIES[case.op][1](case.args)


# ----------------------------------------------------------------------------- the check (every rank)

_MESHES = {}


def _mesh(shape):
    if shape not in _MESHES:
        _MESHES[shape] = hp.init_device_mesh("cpu", shape, mesh_dim_names=MESH_NAMES[len(shape)])
    return _MESHES[shape]


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def check_case(case):
    """Run ``case`` on every rank: values and gradients against one process. Returns the output count."""
    import torch.distributed as dist
    mesh = _mesh(tuple(case.mesh))
    assert dist.get_world_size() == mesh.size(), (case, dist.get_world_size())
    ctx = f"{case!r}"
    try:
        return _check(case, mesh, ctx)
    except AssertionError as e:
        raise AssertionError(f"{ctx}\n{e}") from None
    except Exception as e:  # noqa: BLE001 - name the case in every failure
        raise type(e)(f"{ctx}\n{type(e).__name__}: {e}") if _reraisable(e) else e


def _reraisable(e):
    try:
        type(e)("x")
        return True
    except Exception:  # noqa: BLE001
        return False


def _check(case, mesh, ctx):
    fn = op_fn(case)
    fulls = make_inputs(case)
    grads = [t.is_floating_point() for t in fulls]
    refs = [t.detach().clone().requires_grad_(g) for t, g in zip(fulls, grads)]
    ref = _as_list(fn(*refs))
    ws = [torch.randn(r.shape, generator=torch.Generator().manual_seed(1234 + i), dtype=DT)
          if r.is_floating_point() else None for i, r in enumerate(ref)]
    diff = [i for i, r in enumerate(ref) if r.requires_grad]
    if diff:
        sum((ref[i] * ws[i]).sum() for i in diff).backward()

    def build():
        return [make_dtensor(t, mesh, spec, g) if spec is not None else (t.clone(), None, None)
                for t, g, (_, _, spec) in zip(fulls, grads, case.inputs)]

    if case.warm:
        fn(*[b[0] for b in build()])
    built = build()
    dts = [b[0] for b in built]
    outs = _as_list(fn(*dts))
    assert len(outs) == len(ref), f"{len(outs)} outputs, one process gives {len(ref)}"
    for i, o in enumerate(outs):
        assert isinstance(o, hp.DTensor), f"output {i} is a {type(o).__name__}, not a DTensor"
        assert tuple(o.shape) == tuple(ref[i].shape), f"output {i} global shape {tuple(o.shape)} != {tuple(ref[i].shape)}"
        assert o.dtype == ref[i].dtype, f"output {i} dtype {o.dtype} != {ref[i].dtype}"
    got = [o.full_tensor() for o in outs]
    for i, (g, r) in enumerate(zip(got, ref)):
        if r.is_floating_point():
            torch.testing.assert_close(g, r.detach(), msg=lambda m, i=i: f"value of output {i}: {m}", equal_nan=True, **TOL)
        else:
            assert torch.equal(g, r), f"output {i} (integer) differs:\n{g}\nvs one process\n{r}"
    if not diff:
        return len(outs)
    if case.loss == "full":
        sum((got[i] * ws[i]).sum() for i in diff).backward()
    else:  # a DTensor loss: weights laid out like each output (Partial -> Replicate), DTensor backward
        loss = None
        for i in diff:
            pl = [Replicate() if p.is_partial() else p for p in outs[i].placements]
            w = hp.distribute_tensor(ws[i], outs[i].device_mesh, pl, src_data_rank=None)
            term = (outs[i] * w).sum()
            loss = term if loss is None else loss + term
        loss.backward()
    for i, (r, (d, local, fb)) in enumerate(zip(refs, built)):
        if not r.requires_grad or not isinstance(d, hp.DTensor):
            continue
        if local is not None:  # a Partial(avg/max/min) piece: its own gradient
            want = torch.zeros_like(r) if r.grad is None else r.grad * fb[0]
            want = hp.distribute_tensor(want, mesh, fb[1], src_data_rank=None).to_local()
            assert local.grad is not None, f"the piece of input {i} got no gradient"
            torch.testing.assert_close(local.grad, want, msg=lambda m, i=i: f"gradient of the piece of input {i}: {m}",
                                       equal_nan=True, **TOL)
            continue
        if r.grad is None:
            assert d.grad is None or not d.grad.full_tensor().any(), f"input {i} has a gradient, one process none"
            continue
        assert d.grad is not None, f"input {i} got no gradient"
        assert isinstance(d.grad, hp.DTensor), f"input {i}'s gradient is a {type(d.grad).__name__}"
        torch.testing.assert_close(d.grad.full_tensor(), r.grad, msg=lambda m, i=i: f"gradient of input {i}: {m}",
                                   equal_nan=True, **TOL)
    return len(outs)


def check_cases(cases):
    """Several cases in one task (the regression tests); returns the number checked."""
    for c in cases:
        check_case(c)
    return len(cases)
