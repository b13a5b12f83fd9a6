"""Property-based correctness sweep (issue 26, item 6): hypothesis draws cases, every rank checks them.

Hypothesis runs here, in the pytest process: it draws a :class:`tests.harness.sweep_cases.Case` (a mesh
of 1 to 3 dims, an op of one rule family with its arguments, global shapes that mostly split
unevenly, placements per input in both spellings: objects with ``Partial`` of each reduce op
sum/avg/max/min, or alias names with tuples over several mesh dims), sends it to the gloo worker
pool with ``dist_runner.run``, and every rank runs the same check (``check_case``): values of every
output and gradients of every DTensor input against the same computation on full tensors in one
process, float64, 1e-10. A failing rank fails the test; hypothesis prints the falsifying ``Case``,
which ``tests/dispatch/test_sweep_regressions.py`` turns into an ordinary test.

Profiles (``HYPOTHESIS_PROFILE``; ``scripts/sweep_long.sh`` runs the long one):

* ``ci`` (default): derandomized (a fixed seed per test), no example database, no shrinking (a
  failure is reported at once with its example), ``EXAMPLES`` (100) examples per family on 4 ranks
  ((4,) and (2, 2) meshes), ``SMALL`` (100) on 2 ranks and 100 on 8 ranks ((2, 2, 2)): 1000 cases.
* ``long``: ``HP_SWEEP_EXAMPLES`` (default 150) per family and per world size, shrinking on;
  ``HP_SWEEP_SEED=<int>`` draws another sequence (without it: the same derandomized one, longer).
"""
from __future__ import annotations

import os

import hypothesis
import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from tests.harness.sweep_cases import FAMILIES, MESH_NAMES, Case, check_case

EXAMPLES = 100         # per family on 4 ranks in CI (8 families: 800 cases)
SMALL = 100            # on 2 ranks and on 8 ranks, all families mixed

_common = dict(database=None, deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                      HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("ci", derandomize=True, phases=[Phase.explicit, Phase.generate], **_common)
settings.register_profile("long", derandomize=os.environ.get("HP_SWEEP_SEED") is None,
                          phases=[Phase.explicit, Phase.generate, Phase.shrink], **_common)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    PROFILE = "ci"
settings.load_profile(PROFILE)
if PROFILE == "long":
    EXAMPLES = SMALL = int(os.environ.get("HP_SWEEP_EXAMPLES", "150"))


def _n(k):
    return settings(max_examples=k)


def _seeded(fn):
    s = os.environ.get("HP_SWEEP_SEED")
    return hypothesis.seed(int(s))(fn) if (s and PROFILE == "long") else fn


# ----------------------------------------------------------------------------- shapes

SIZE = st.integers(1, 7)      # uneven over 2, 3 or 4 pieces most of the time, empty pieces when < pieces


def shape(draw, lo=1, hi=3):
    return tuple(draw(st.lists(SIZE, min_size=lo, max_size=hi)))


def bcast(draw, s):
    """A shape that broadcasts against ``s``: a suffix of it with some dims 1."""
    k = draw(st.integers(0 if len(s) > 1 else 1, len(s)))
    tail = s[len(s) - k:]
    return tuple(1 if draw(st.booleans()) and draw(st.booleans()) else d for d in tail) or (s[-1],)


# ----------------------------------------------------------------------------- placements

def placements(draw, mesh, nd, partial=True, plain=False):
    """A spec for an ``nd``-d tensor: objects (with a Partial op) or alias names (tuples included)."""
    if plain and draw(st.integers(0, 3)) == 0:
        return None
    names = MESH_NAMES[len(mesh)]
    if nd == 0 or draw(st.booleans()):
        op = draw(st.sampled_from(["sum", "avg", "max", "min"]))
        choices = ["R"] + [f"S{d}" for d in range(nd)] + ([f"P:{op}"] if partial else [])
        toks = tuple(draw(st.sampled_from(choices)) for _ in mesh)
        return ("obj", toks)
    dims = [draw(st.integers(-1, nd - 1)) for _ in names]
    order = draw(st.permutations(names))
    alias = []
    for t in range(nd):
        on = tuple(n for n in order if dims[names.index(n)] == t)
        alias.append("None" if not on else on[0] if len(on) == 1 else on)
    return ("alias", tuple(alias))


# ----------------------------------------------------------------------------- one strategy per family
# each returns (op, args, [(shape, kind), ...]); the generic code adds placements

def s_elementwise(draw):
    which = draw(st.sampled_from(["unary", "binary", "binary", "addcmul"]))
    s = shape(draw, 1, 3)
    if which == "unary":
        from tests.harness.sweep_cases import _UNARY
        return "unary", (draw(st.sampled_from(sorted(_UNARY))),), [(s, "f")]
    if which == "binary":
        from tests.harness.sweep_cases import _BINARY
        a, b = s, bcast(draw, s)
        if draw(st.booleans()):
            a, b = b, a
        return "binary", (draw(st.sampled_from(sorted(_BINARY))),), [(a, "f"), (b, "f")]
    return "addcmul", (), [(s, "f"), (bcast(draw, s), "f"), (bcast(draw, s), "f")]


def s_reduction(draw):
    s = shape(draw, 1, 3)
    nd = len(s)
    which = draw(st.sampled_from(["reduce", "reduce", "max_dim", "argmax"]))
    keep = draw(st.booleans())
    if which == "reduce":
        f = draw(st.sampled_from(["sum", "mean", "amax", "amin", "prod", "logsumexp", "var", "std", "norm2",
                                  "norm3", "norminf", "max_all", "min_all", "nansum"]))
        if f in ("max_all", "min_all"):
            dim = None
        elif f == "prod":
            dim = draw(st.one_of(st.none(), st.integers(-nd, nd - 1)))
        else:
            dim = draw(st.one_of(st.none(), st.integers(-nd, nd - 1),
                                 st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True).map(tuple)))
        if f in ("var", "std") and dim is None:
            keep = False
        return "reduce", (f, dim, keep), [(s, "f")]
    dim = draw(st.integers(-nd, nd - 1))
    if which == "max_dim":
        return "max_dim", (draw(st.sampled_from(["max", "min"])), dim, keep), [(s, "f")]
    return "argmax", (draw(st.sampled_from(["argmax", "argmin"])), dim, keep), [(s, "f")]


def _partition(draw, n):
    """Split ``range(n)`` into contiguous groups: a list of group lengths."""
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    bounds = [0] + cuts + [n]
    return [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]


def _group(atoms, lens):
    out, i = [], 0
    for k in lens:
        p = 1
        for a in atoms[i:i + k]:
            p *= a
        out.append(p)
        i += k
    return tuple(out)


def s_view(draw):
    which = draw(st.sampled_from(["reshape", "reshape", "view_op", "view_op", "view_op", "cat"]))
    if which == "reshape":
        atoms = draw(st.lists(st.integers(1, 4), min_size=2, max_size=4))
        a = _group(atoms, _partition(draw, len(atoms)))
        b = _group(atoms, _partition(draw, len(atoms)))
        if draw(st.integers(0, 4)) == 0:
            b = (-1,) + b[1:] if len(b) > 1 else (-1,)
        return "reshape", (draw(st.sampled_from(["reshape", "view"])), b), [(a, "f")]
    if which == "cat":
        s = shape(draw, 1, 3)
        n = draw(st.integers(2, 3))
        name = draw(st.sampled_from(["cat", "stack"]))
        if name == "stack":
            return "cat", ("stack", draw(st.integers(0, len(s)))), [(s, "f")] * n
        dim = draw(st.integers(0, len(s) - 1))
        shapes = [s[:dim] + (draw(SIZE),) + s[dim + 1:] for _ in range(n)]
        return "cat", ("cat", dim), [(t, "f") for t in shapes]
    name = draw(st.sampled_from(["transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten", "expand",
                                 "movedim", "narrow", "select", "slice", "repeat", "flip", "roll", "tril", "triu",
                                 "t", "transpose_reshape", "split", "chunk", "unbind"]))
    s = shape(draw, 2 if name in ("tril", "triu", "t", "transpose") else 1, 3)
    nd = len(s)
    dim = draw(st.integers(0, nd - 1))
    if name == "t":
        s = s[:2]
        p = None
    elif name == "transpose":
        p = (dim, draw(st.integers(0, nd - 1)))
    elif name == "permute":
        p = tuple(draw(st.permutations(range(nd))))
    elif name == "unsqueeze":
        p = draw(st.integers(0, nd))
    elif name == "squeeze":
        s = s[:dim] + (1,) + s[dim + 1:]
        p = dim
    elif name == "flatten":
        p = (dim, draw(st.integers(dim, nd - 1)))
    elif name == "unflatten":
        a, b = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        s = s[:dim] + (a * b,) + s[dim + 1:]
        p = (dim, (a, b))
    elif name == "expand":
        s = tuple(1 if draw(st.booleans()) else d for d in s)
        p = tuple(draw(st.integers(1, 5)) if d == 1 else d for d in s)
        if draw(st.booleans()):
            p = (draw(st.integers(1, 3)),) + p
    elif name == "movedim":
        p = (dim, draw(st.integers(0, nd - 1)))
    elif name == "narrow":
        start = draw(st.integers(0, s[dim] - 1))
        p = (dim, start, draw(st.integers(1, s[dim] - start)))
    elif name == "select":
        p = (dim, draw(st.integers(-s[dim], s[dim] - 1)))
    elif name == "slice":
        p = (dim, draw(st.integers(0, s[dim])), draw(st.integers(0, s[dim])), draw(st.integers(1, 3)))
    elif name == "repeat":
        p = tuple(draw(st.integers(1, 3)) for _ in s)
    elif name == "flip":
        p = tuple(draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True)))
    elif name == "roll":
        p = (draw(st.integers(-5, 5)), dim)
    elif name in ("tril", "triu"):
        p = draw(st.integers(-3, 3))
    elif name == "transpose_reshape":
        p = None
    elif name == "split":
        p = (draw(st.integers(1, s[dim])), dim)
    elif name == "chunk":
        p = (draw(st.integers(1, 4)), dim)
    else:  # unbind
        p = dim
    return "view_op", (name, p), [(s, "f")]


def s_matmul(draw):
    name = draw(st.sampled_from(["matmul", "matmul", "linear", "addmm", "baddbmm", "bmm", "mm", "mv", "dot", "outer",
                                 "einsum"]))
    m, k, n, b = (draw(SIZE) for _ in range(4))
    if name == "matmul":
        form = draw(st.sampled_from(["2x2", "3x2", "3x3", "2x1", "1x2", "3xb"]))
        shapes = {"2x2": [(m, k), (k, n)], "3x2": [(b, m, k), (k, n)], "3x3": [(b, m, k), (b, k, n)],
                  "2x1": [(m, k), (k,)], "1x2": [(k,), (k, n)], "3xb": [(b, m, k), (1, k, n)]}[form]
        return "matmul", ("matmul",), [(s, "f") for s in shapes]
    if name == "linear":
        x = ((b,) if draw(st.booleans()) else ()) + (m, k)
        ins = [(x, "f"), ((n, k), "f")] + ([((n,), "f")] if draw(st.booleans()) else [])
        return "matmul", ("linear",), ins
    if name == "addmm":
        c = draw(st.sampled_from([(n,), (m, n), (m, 1)]))
        return "matmul", ("addmm", draw(st.sampled_from([1.0, 0.5])), draw(st.sampled_from([1.0, -2.0]))), \
            [(c, "f"), ((m, k), "f"), ((k, n), "f")]
    if name == "baddbmm":
        return "matmul", ("baddbmm", 0.5, 1.5), [((b, m, n), "f"), ((b, m, k), "f"), ((b, k, n), "f")]
    if name == "bmm":
        return "matmul", ("bmm",), [((b, m, k), "f"), ((b, k, n), "f")]
    if name == "mm":
        return "matmul", ("mm",), [((m, k), "f"), ((k, n), "f")]
    if name == "mv":
        return "matmul", ("mv",), [((m, k), "f"), ((k,), "f")]
    if name == "dot":
        return "matmul", ("dot",), [((k,), "f"), ((k,), "f")]
    if name == "outer":
        return "matmul", ("outer",), [((m,), "f"), ((n,), "f")]
    h = draw(SIZE)
    eq, shapes = draw(st.sampled_from([
        ("bij,bjk->bik", [(b, m, k), (b, k, n)]), ("ij,kj->ik", [(m, k), (n, k)]),
        ("bhqd,bhkd->bhqk", [(b, h, m, k), (b, h, n, k)]), ("i,j->ij", [(m,), (n,)]),
        ("bsd,de->bse", [(b, m, k), (k, n)]), ("ij->j", [(m, k)]), ("ijk->kij", [(m, k, n)]),
    ]))
    return "matmul", ("einsum", eq), [(s, "f") for s in shapes]


def s_indexing(draw):
    name = draw(st.sampled_from(["index_select", "gather", "scatter", "scatter_add", "scatter_reduce", "index_add",
                                 "getitem_idx", "masked_fill", "embedding", "setitem_slice"]))
    s = shape(draw, 1, 3)
    nd = len(s)
    dim = draw(st.integers(0, nd - 1))
    if name == "index_select":
        return "indexing", (name, dim), [(s, "f"), ((draw(SIZE),), ("i", s[dim]))]
    if name == "gather":
        idx = tuple(draw(SIZE) if d == dim else draw(st.integers(1, s[d])) for d in range(nd))
        return "indexing", (name, dim), [(s, "f"), (idx, ("i", s[dim]))]
    if name in ("scatter", "scatter_add", "scatter_reduce"):
        idx = tuple(draw(st.integers(1, s[d])) for d in range(nd))
        src = idx  # torch's scatter backward needs src shaped like index (a larger src raises in one process too)
        kind = ("u", dim, s[dim]) if name == "scatter" else ("i", s[dim])
        args = (name, dim)
        if name == "scatter_reduce":
            args += (draw(st.sampled_from(["sum", "mean", "amax", "amin", "prod"])), draw(st.booleans()))
        return "indexing", args, [(s, "f"), (idx, kind), (src, "f")]
    if name == "index_add":
        n = draw(SIZE)
        src = s[:dim] + (n,) + s[dim + 1:]
        return "indexing", (name, dim), [(s, "f"), ((n,), ("i", s[dim])), (src, "f")]
    if name == "getitem_idx":
        ishape = shape(draw, 1, 2)
        return "indexing", (name, dim), [(s, "f"), (ishape, ("i", s[dim]))]
    if name == "masked_fill":
        return "indexing", (name,), [(s, "f")]
    if name == "embedding":
        v, d = draw(SIZE), draw(SIZE)
        return "indexing", (name,), [(shape(draw, 1, 2), ("i", v)), ((v, d), "f")]
    a = draw(st.integers(0, s[dim] - 1))
    b = draw(st.integers(a + 1, s[dim]))
    return "indexing", (name, dim, a, b), [(s, "f"), (s[:dim] + (b - a,) + s[dim + 1:], "f")]


def s_softmax_norm(draw):
    name = draw(st.sampled_from(["softmax", "log_softmax", "softmin", "layer_norm", "rms_norm", "normalize",
                                 "cross_entropy", "nll_loss", "sdpa"]))
    s = shape(draw, 1, 3)
    nd = len(s)
    if name in ("softmax", "log_softmax", "softmin", "normalize"):
        return "norm", (name, draw(st.integers(-nd, nd - 1))), [(s, "f")]
    if name in ("layer_norm", "rms_norm"):
        k = draw(st.integers(1, nd))
        ns = s[nd - k:]
        ins = [(s, "f")]
        if draw(st.booleans()):
            ins.append((ns, "f"))
            if name == "layer_norm" and draw(st.booleans()):
                ins.append((ns, "f"))
        return "norm", (name, ns), ins
    if name in ("cross_entropy", "nll_loss"):
        N, C = draw(SIZE), draw(st.integers(2, 7))
        extra = (draw(SIZE),) if draw(st.booleans()) else ()
        red = draw(st.sampled_from(["mean", "sum", "none"]))
        args = (name, red) + ((draw(st.sampled_from([0.0, 0.1])),) if name == "cross_entropy" else ())
        return "norm", args, [((N, C) + extra, "f"), ((N,) + extra, ("i", C))]
    b, h, sq, d = draw(SIZE), draw(st.integers(1, 4)), draw(SIZE), draw(st.integers(1, 5))
    causal = draw(st.booleans())
    sk = sq if causal else draw(SIZE)
    dv = draw(st.integers(1, 5))
    return "norm", ("sdpa", causal), [((b, h, sq, d), "f"), ((b, h, sk, d), "f"), ((b, h, sk, dv), "f")]


def s_sort_topk(draw):
    s = shape(draw, 1, 3)
    nd = len(s)
    dim = draw(st.integers(-nd, nd - 1))
    name = draw(st.sampled_from(["sort", "topk", "topk", "kthvalue", "argsort"]))
    if name in ("sort", "argsort"):
        return "sort", (name, dim, draw(st.booleans())), [(s, "f")]
    k = draw(st.integers(1, s[dim]))
    if name == "topk":
        return "sort", (name, k, dim, draw(st.booleans())), [(s, "f")]
    return "sort", (name, k, dim, draw(st.booleans())), [(s, "f")]


def s_cumulative(draw):
    s = shape(draw, 1, 3)
    nd = len(s)
    name = draw(st.sampled_from(["cumsum", "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"]))
    return "scan", (name, draw(st.integers(-nd, nd - 1))), [(s, "f")]


STRATEGIES = {
    "elementwise": s_elementwise, "reduction": s_reduction, "view": s_view, "matmul": s_matmul,
    "indexing": s_indexing, "softmax_norm": s_softmax_norm, "sort_topk": s_sort_topk, "cumulative": s_cumulative,
}
assert set(STRATEGIES) == {fam for fam, _ in FAMILIES.values()}

MESHES = {2: [(2,)], 4: [(4,), (2, 2)], 8: [(2, 2, 2)]}


def _unshard(spec, dim):
    """``spec`` without a shard of tensor dim ``dim`` and without Partial (objects or aliases)."""
    kind, body = spec
    if kind == "obj":
        return kind, tuple("R" if t == f"S{dim}" or t.startswith("P:") else t for t in body)
    return kind, tuple("None" if t == dim else a for t, a in enumerate(body))


def _fixup(op, args, inputs):
    """Documented limits that are not bugs: in-place ``__setitem__`` cannot change its target's layout, so a
    slice of a sharded dim or a Partial target raises (docs/ops.md); such targets are drawn unsharded there."""
    if op == "indexing" and args[0] == "setitem_slice":
        s, kind, spec = inputs[0]
        inputs[0] = (s, kind, _unshard(spec, args[1]))
    return inputs


@st.composite
def cases(draw, world_size, families=tuple(STRATEGIES)):
    mesh = draw(st.sampled_from(MESHES[world_size]))
    fam = draw(st.sampled_from(families))
    op, args, ins = STRATEGIES[fam](draw)
    inputs = []
    for s, kind in ins:
        if kind == "f":
            spec = placements(draw, mesh, len(s))
        else:
            spec = placements(draw, mesh, len(s), partial=False, plain=True)
        inputs.append((tuple(s), kind, spec))
    inputs = _fixup(op, args, inputs)
    return Case(op=op, args=args, mesh=mesh, inputs=tuple(inputs), seed=draw(st.integers(0, 2 ** 16)),
                warm=draw(st.booleans()), loss=draw(st.sampled_from(["full", "dtensor"])))


RUN_COUNT = {}


def _run(dist_runner, world_size, case):
    note(f"case: {case!r}")
    RUN_COUNT[world_size] = RUN_COUNT.get(world_size, 0) + 1
    dist_runner.run(world_size, check_case, case, timeout=60)


# ----------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("family", sorted(STRATEGIES))
def test_sweep_4_ranks(dist_runner, family):
    """(4,) and (2, 2) meshes, ``EXAMPLES`` cases of one family per run."""
    @_seeded
    @_n(EXAMPLES)
    @given(case=cases(4, (family,)))
    def body(case):
        _run(dist_runner, 4, case)
    before = RUN_COUNT.get(4, 0)
    body()
    assert RUN_COUNT[4] - before >= EXAMPLES, (RUN_COUNT[4] - before, EXAMPLES)   # every example ran


def test_sweep_2_ranks(dist_runner):
    @_seeded
    @_n(SMALL)
    @given(case=cases(2))
    def body(case):
        _run(dist_runner, 2, case)
    before = RUN_COUNT.get(2, 0)
    body()
    assert RUN_COUNT[2] - before >= SMALL, (RUN_COUNT[2] - before, SMALL)


def test_sweep_8_ranks(dist_runner):
    """(2, 2, 2) meshes: alias tuples over up to three mesh dims, Partial on several."""
    @_seeded
    @_n(SMALL)
    @given(case=cases(8))
    def body(case):
        _run(dist_runner, 8, case)
    before = RUN_COUNT.get(8, 0)
    body()
    assert RUN_COUNT[8] - before >= SMALL, (RUN_COUNT[8] - before, SMALL)


def test_strategies_cover_both_spellings_and_every_reduce_op():
    """The drawn specs include objects with each Partial op, alias tuples, plain index tensors (no processes)."""
    seen = set()

    @settings(max_examples=300, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases(8))
    def collect(case):
        for _, _, spec in case.inputs:
            if spec is None:
                seen.add("plain")
            elif spec[0] == "alias":
                seen.add("alias")
                seen.update("alias_tuple" for a in spec[1] if isinstance(a, tuple))
            else:
                seen.update(t for t in spec[1] if t.startswith("P:"))
        seen.add(FAMILIES[case.op][0])
    collect()
    want = {"plain", "alias", "alias_tuple", "P:sum", "P:avg", "P:max", "P:min"} | set(STRATEGIES)
    assert want <= seen, want - seen


# ----------------------------------------------------------------------------- the check can fail

def _mutants_body():
    """Two deliberately wrong rules, each caught by ``check_case``: wrong values and wrong gradients."""
    import torch
    from hyper_parallel.dispatch.rules import base

    class ScanOnShards(base.DistributedOp):
        """cumsum on each shard alone (keeps the scan dim sharded): wrong values."""
        def strategy(self, call):
            return base.Strategy(list(call.layouts), call.layouts[0].without_partial())

    class TanhNoGrad(base.DistributedOp):
        """tanh with the right values and no gradient."""
        def strategy(self, call):
            lay = call.layouts[0].without_partial()
            return base.Strategy([lay], lay, local_fn=lambda x: torch.tanh(x.detach()) + 0 * x)

    caught = []
    for name, rule, case in [
        ("cumsum", ScanOnShards("cumsum", register=False),
         Case(op="scan", args=("cumsum", 0), mesh=(2,), inputs=(((5, 3), "f", ("obj", ("S0",))),))),
        ("tanh", TanhNoGrad("tanh", register=False),
         Case(op="unary", args=("tanh",), mesh=(2,), inputs=(((5, 3), "f", ("alias", ("None", "tp"))),))),
    ]:
        check_case(case)   # the built-in rule passes
        with base.override(name, rule):
            try:
                check_case(case)
            except AssertionError as e:
                caught.append((name, "value of output 0" in str(e), "gradient of input 0" in str(e)))
    return caught


def test_the_check_catches_wrong_rules(dist_runner):
    assert dist_runner.run(2, _mutants_body)[0] == [("cumsum", True, False), ("tanh", False, True)]
