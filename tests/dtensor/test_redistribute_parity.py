"""Acceptance test: exhaustive redistribution parity on real gloo process groups.

For every (src, dst) pair of placements on meshes (4,), (2, 2) and (2, 2, 2) and
for an even and an uneven 2-D shape (the uneven one has a dim smaller than the
number of ranks), each rank checks:

* forward: ``x.redistribute(dst)`` has the right placements and global shape,
  ``to_local()`` equals the ``torch.chunk`` ground truth (computed here, without
  the library) and ``full_tensor()`` equals the original tensor;
* backward: the gradient of ``(y.full_tensor() * W).sum()`` w.r.t. the source
  leaf equals ``W`` sliced like the source (Replicate/Partial(sum): full ``W``;
  Partial(avg): ``W / k``; Partial(max/min): ``W`` masked to the arg-max rank);
* communication: CommDebugMode counts and bytes per kind on this rank, for the
  redistribution and for the following ``full_tensor()``, equal the planner's
  prediction ``plan.steps[i].bytes[rank]``.

All cases of a mesh run inside one distributed call (looping on every rank).
Value mismatches are collected and reported with the exact (src, dst, shape);
an exception inside a collective is re-raised at once with the same context
(the harness then reports that rank's traceback).

The (2, 2, 2) mesh runs the complete product too (4480 cases, about 5 minutes on
8 ranks sharing 2 cores). Set ``HP_PARITY_QUICK=1`` for a quick local run that pairs
every source with a fixed, seeded sample of targets there instead.
"""
from __future__ import annotations

import itertools
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from hyper_parallel.dtensor import redistribute_plan as rp
from tests.harness import requires_world_size

R, S0, S1 = Replicate(), Shard(0), Shard(1)
P, PAVG, PMAX, PMIN, PPROD = Partial("sum"), Partial("avg"), Partial("max"), Partial("min"), Partial("prod")

MESHES = {
    "1d": dict(shape=(4,), names=("x",), tensors=[(8, 12), (3, 5)]),
    "2d": dict(shape=(2, 2), names=("dp", "tp"), tensors=[(8, 12), (3, 5)]),
    "3d": dict(shape=(2, 2, 2), names=("pp", "dp", "tp"), tensors=[(8, 8), (3, 5)]),
}


# ---------------------------------------------------------------------- case lists

def _spec_str(spec) -> str:
    if all(isinstance(p, hp.Placement) for p in spec):
        return "[" + ",".join(str(p) for p in spec) + "]"
    return repr(tuple(spec))


def _is_alias(spec) -> bool:
    return not all(isinstance(p, hp.Placement) for p in spec)


def _cases(mesh_key: str):
    """Deterministic (src, dst, shape) list; identical on every rank."""
    cfg = MESHES[mesh_key]
    n = len(cfg["shape"])
    if n == 1:
        srcs = [(p,) for p in (R, S0, S1, P, PAVG, PMAX, PMIN, PPROD)] + [("x", "None"), ("None", "x")]
        dsts = [(p,) for p in (R, S0, S1, P)] + [("None", "x")]
        pairs = [(s, d) for s in srcs for d in dsts]
    elif n == 2:
        srcs = list(itertools.product((R, S0, S1, P), repeat=2))
        srcs += [(PAVG, S0), (PMAX, R), (S1, PMIN), (PAVG, PAVG), (PMAX, PMAX), (PPROD, S0), (PPROD, PPROD)]
        srcs += [(("tp", "dp"), "None"), ("None", ("tp", "dp")), ("tp", "dp"), (("dp", "tp"), "None")]
        dsts = list(itertools.product((R, S0, S1), repeat=2))
        dsts += [(P, R), (S0, P), (P, P)]
        dsts += [(("tp", "dp"), "None"), ("None", ("tp", "dp")), ("tp", "dp")]
        pairs = [(s, d) for s in srcs for d in dsts]
    else:
        srcs = list(itertools.product((R, S0, S1, P), repeat=3))
        srcs += [(PAVG, R, S1), (S0, PMAX, R), (PMAX, PMAX, PMAX), (S0, R, PPROD)]
        srcs += [(("tp", "pp"), "dp"), ("None", ("dp", "pp", "tp")), (("tp", "dp", "pp"), "None")]
        dsts = list(itertools.product((R, S0, S1), repeat=3))
        dsts += [(P, R, S0), (R, S1, P)]
        dsts += [(("tp", "pp"), "dp"), ("None", ("tp", "dp", "pp")), ("dp", ("tp", "pp"))]
        if os.environ.get("HP_PARITY_QUICK") != "1":
            pairs = [(s, d) for s in srcs for d in dsts]
        else:
            rng = random.Random(1234)
            pairs = []
            for s in srcs:  # every source, every target at least once, a seeded sample of the rest
                pairs += [(s, d) for d in rng.sample(dsts, 3)]
            for i, d in enumerate(dsts):
                pairs.append((srcs[(7 * i) % len(srcs)], d))
            # the structured corners: all sources to full Replicate / to [S0,S1,S0]
            pairs += [(s, (R, R, R)) for s in srcs] + [(s, (S0, S1, S0)) for s in srcs[::3]]
            pairs = list(dict.fromkeys(pairs))
    return [(s, d, shape) for shape in cfg["tensors"] for (s, d) in pairs]


# ---------------------------------------------------------------------- ground truth (no library)

def _chunk(t: torch.Tensor, k: int, dim: int, idx: int) -> torch.Tensor:
    chunks = torch.chunk(t, k, dim) if t.shape[dim] else ()
    if idx < len(chunks):
        return chunks[idx]
    return t.narrow(dim, t.shape[dim], 0)


def _gt_slice(t, mesh_shape, names, coord, spec):
    """This rank's piece of the global ``t`` under ``spec``, by sequential torch.chunk."""
    ndim = t.dim()
    if _is_alias(spec):
        for tdim, a in enumerate(spec):
            for name in (a if isinstance(a, tuple) else (a,)):
                if name != "None":
                    d = names.index(name)
                    t = _chunk(t, mesh_shape[d], tdim, coord[d])
    else:
        for d, p in enumerate(spec):
            if isinstance(p, Shard):
                t = _chunk(t, mesh_shape[d], p.dim % ndim, coord[d])
    return t


def _partial_dims(spec):
    if _is_alias(spec):
        return [], None
    dims = [d for d, p in enumerate(spec) if isinstance(p, Partial)]
    ops = {spec[d].reduce_op for d in dims}
    assert len(ops) <= 1, "test only mixes one reduce op per source"
    return dims, (ops.pop() if ops else None)


def _partial_parts(full, n):
    """``n`` global tensors whose reduction is ``full``, plus the arg-max/min owner map."""
    numel = full.numel()
    noise = (torch.arange(numel) % 3 + 1).reshape(full.shape).to(full.dtype)
    owner = (torch.arange(numel) % n).reshape(full.shape)
    parts = {}
    for op in ("sum", "avg", "max", "min"):
        lst = []
        for i in range(n):
            z = noise * (i - (n - 1) / 2)  # sums to exactly zero over i (half-integers)
            if op == "sum":
                lst.append(full * (1.0 if i == 0 else 0.0) + z)
            elif op == "avg":
                lst.append(full + z)
            elif op == "max":
                lst.append(full - (owner != i).to(full.dtype) * (1 + i))
            else:
                lst.append(full + (owner != i).to(full.dtype) * (1 + i))
        parts[op] = lst
    # prod: exact powers of two around ``full``; where ``full`` is 0 the zero sits on part 1, so the
    # backward (product of the other parts, no division) is checked with zeros on other ranks too
    zero = full == 0
    lst = [torch.where(zero, torch.ones_like(full), full) * 2.0 ** -(n - 1)]
    lst += [torch.where(zero, torch.zeros_like(full), torch.full_like(full, 2.0)) if i == 1
            else torch.full_like(full, 2.0) for i in range(1, n)]
    parts["prod"] = lst
    return parts, owner


# ---------------------------------------------------------------------- rank body

def _diff(got, want) -> str:
    """Human-readable description of a mismatch (safe for empty tensors)."""
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != {want.dtype}"
    if got.numel() == 0:
        return "empty tensors compare unequal"
    return f"max err {(got.detach() - want).abs().max().item()}"


def _expected_comm(plan, rank):
    counts = plan.collective_counts()
    nbytes = {}
    for s in plan.steps:
        if s.is_comm:
            nbytes[s.kind] = nbytes.get(s.kind, 0) + s.bytes[rank]
    return counts, nbytes


def _run_case(mesh, mesh_shape, names, src, dst, shape, failures):
    rank = dist.get_rank()
    coord = mesh.get_coordinate()
    tag = f"src={_spec_str(src)} dst={_spec_str(dst)} shape={shape}"
    numel = shape[0] * shape[1]
    full = (torch.arange(numel, dtype=torch.float32).reshape(shape) * 0.5 - 3.0)
    W = ((torch.arange(numel, dtype=torch.float32) * 7 % 11) - 5).reshape(shape)

    def check(cond, what):
        """Record a failure; ``what`` is a string or a callable building it (only on failure)."""
        if not cond:
            failures.append(f"rank {rank} {tag}: {what() if callable(what) else what}")
        return cond

    pdims, op = _partial_dims(src)
    mask = None
    scale = 1.0
    if pdims:
        n = 1
        for d in pdims:
            n *= mesh_shape[d]
        idx = 0
        for d in pdims:
            idx = idx * mesh_shape[d] + coord[d]
        parts, owner = _partial_parts(full, n)
        local = _gt_slice(parts[op][idx], mesh_shape, names, coord, src).clone().requires_grad_(True)
        x = hp.DTensor.from_local(local, mesh, list(src), shape=shape, stride=full.stride())
        leaf_grad = lambda: local.grad  # noqa: E731
        if op == "avg":
            scale = 1.0 / n
        elif op in ("max", "min"):
            mask = _gt_slice((owner == idx).to(torch.float32), mesh_shape, names, coord, src)
        elif op == "prod":  # d(prod)/d(part idx) = product of the other parts
            others = torch.ones_like(full)
            for j in range(n):
                if j != idx:
                    others = others * parts[op][j]
            mask = _gt_slice(others, mesh_shape, names, coord, src)
    else:
        x = hp.distribute_tensor(full.clone().requires_grad_(True), mesh, src, src_data_rank=None)
        leaf_grad = lambda: (x.grad.to_local() if x.grad is not None else None)  # noqa: E731

    try:
        new_partial = not _is_alias(dst) and any(
            isinstance(p, Partial) and p != x.placements[d] for d, p in enumerate(dst))
        if new_partial:
            # PyTorch refuses a new Partial in the public API (before any collective); the library's
            # internal _redistribute supports it, and the value must still be kept exactly
            try:
                x.redistribute(mesh, dst)
                raise AssertionError(f"redistribute to a new Partial {dst} from {x.placements} did not raise")
            except RuntimeError as e:
                assert "redistributing to Partial is for internal use only" in str(e), e
        with hp.CommDebugMode() as comm:
            y = (x._redistribute if new_partial else x.redistribute)(mesh, dst)
        fwd_plan = rp.plan(x.layout, y.layout, shape, 4)
        with hp.CommDebugMode() as comm_full:
            f = y.full_tensor()
        full_plan = rp.plan(y.layout, y.layout.replicated(), shape, 4)
        (f * W).sum().backward()
    except Exception as e:  # a collective failed: ranks may be out of step, stop here
        raise RuntimeError(f"rank {rank} {tag}: {type(e).__name__}: {e}") from e

    # forward values and metadata
    check(tuple(y.shape) == tuple(shape), f"shape {tuple(y.shape)} != {shape}")
    if _is_alias(dst):
        check(y.alias_placements == tuple(dst), f"alias_placements {y.alias_placements} != {dst}")
    else:
        check(tuple(y.placements) == tuple(dst), f"placements {y.placements} != {dst}")
    if not any(isinstance(p, Partial) for p in (() if _is_alias(dst) else dst)):
        want = _gt_slice(full, mesh_shape, names, coord, dst)
        got = y.to_local()
        if check(tuple(got.shape) == tuple(want.shape), f"local shape {tuple(got.shape)} != {tuple(want.shape)}"):
            check(torch.equal(got, want), lambda: f"to_local values differ ({_diff(got, want)})")
    check(f.shape == full.shape and torch.equal(f.detach(), full),
          lambda: "full_tensor differs" + (f" ({_diff(f, full)})" if f.shape == full.shape else f" shape {tuple(f.shape)}"))

    # backward
    want_g = _gt_slice(W, mesh_shape, names, coord, src) * scale
    if mask is not None:
        want_g = want_g * mask
    g = leaf_grad()
    if check(g is not None, "source got no gradient"):
        if check(tuple(g.shape) == tuple(want_g.shape), f"grad shape {tuple(g.shape)} != {tuple(want_g.shape)}"):
            check(torch.allclose(g, want_g, rtol=1e-6, atol=1e-6),
                  lambda: f"grad differs ({_diff(g, want_g)})")

    # communication = planner prediction, per kind, on this rank
    for what, cm, pl in (("redistribute", comm, fwd_plan), ("full_tensor", comm_full, full_plan)):
        counts, nbytes = _expected_comm(pl, rank)
        check(cm.get_comm_counts() == counts, lambda: f"{what}: comm counts {cm.get_comm_counts()} != planned {counts} "
                                              f"(plan {pl})")
        check(cm.get_bytes() == nbytes, lambda: f"{what}: bytes {cm.get_bytes()} != planned {nbytes} (plan {pl})")


def _parity_body(mesh_key):
    cfg = MESHES[mesh_key]
    mesh = hp.init_device_mesh("cpu", cfg["shape"], mesh_dim_names=cfg["names"])
    failures = []
    cases = _cases(mesh_key)
    t0 = time.perf_counter()
    for src, dst, shape in cases:
        _run_case(mesh, cfg["shape"], cfg["names"], src, dst, shape, failures)
    return {"failures": failures, "n": len(cases), "seconds": time.perf_counter() - t0}


def _report(out, mesh_key):
    failures = [f for o in out for f in o["failures"]]
    n = out[0]["n"]
    assert n == len(_cases(mesh_key)) and n > 0
    if failures:
        shown = "\n".join(failures[:40])
        more = f"\n... and {len(failures) - 40} more" if len(failures) > 40 else ""
        pytest.fail(f"{len(failures)} parity failures on mesh {MESHES[mesh_key]['shape']} "
                    f"({n} cases per rank):\n{shown}{more}", pytrace=False)


def test_case_lists_cover_every_pair():
    for key in ("1d", "2d"):
        cases = _cases(key)
        assert len(cases) == len(set((_spec_str(s), _spec_str(d), sh) for s, d, sh in cases))
    c3 = _cases("3d")
    srcs = {_spec_str(s) for s, _, _ in c3}
    dsts = {_spec_str(d) for _, d, _ in c3}
    assert len(srcs) == 4 ** 3 + 7 and len(dsts) == 3 ** 3 + 5


def test_parity_1d_mesh_4(dist_runner):
    _report(dist_runner.run(4, _parity_body, "1d", timeout=170), "1d")


def test_parity_2d_mesh_2x2(dist_runner):
    _report(dist_runner.run(4, _parity_body, "2d", timeout=170), "2d")


@requires_world_size(8)
@pytest.mark.timeout(1000)
def test_parity_3d_mesh_2x2x2(dist_runner):
    _report(dist_runner.run(8, _parity_body, "3d", timeout=900), "3d")
