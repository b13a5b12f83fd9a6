"""Strict layouts (issue 24, class 9): HyperParallel's errors for implicit redistributions, opt-in.

Every case HyperParallel refuses (softmax/cumsum/sort/topk/unbind/split/layer_norm along a sharded dim,
expand and pad of a sharded dim, scatter with disagreeing index/src, masked_scatter and multinomial
and isin on sharded operands, SDPA with K/V sequence sharding or mismatched Q/K/V, squeeze of a
non-singleton dim) raises HyperParallel's exception type under ``hp.strict_layouts()`` with the op, the
dim and the layouts in the message - before any collective - and runs with values and gradients equal
to one process (fp64) without it (the default, PyTorch's behaviour). Warn-only mode warns once per
(op, layouts) with the bytes the plan sends; the environment variable selects the initial mode.
"""
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from hyper_parallel.dispatch import modes
from hyper_parallel.dispatch.modes import StrictLayoutNotImplementedError

from tests.harness.parity import _check, _randn

S0, S1, S2, R = [Shard(0)], [Shard(1)], [Shard(2)], [Replicate()]
VE, NIE = ValueError, NotImplementedError


def _perm_index(rows, cols, seed):
    return torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed)).argsort(dim=1)


def _cases():
    """(label, fn, inputs for _check, exception type, substrings of the message)."""
    x = _randn(4, 6)
    w, b = _randn(6, seed=1), _randn(6, seed=2)
    row = _randn(1, 6, seed=3)
    idx = _perm_index(4, 6, 4)[:, :3]
    src = _randn(4, 3, seed=5)
    mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(6)) > 0.5
    flat = _randn(24, seed=7)
    elems = torch.tensor([3.0, 1.0, 7.0, 2.0, 9.0, 4.0], dtype=torch.float64)
    tests_ = torch.tensor([7.0, 5.0, 3.0], dtype=torch.float64)
    q, k, v = (_randn(2, 2, 8, 4, seed=s) for s in (8, 9, 10))
    sdpa = F.scaled_dot_product_attention
    return [
        ("softmax", lambda a: a.softmax(-1), [(x, S1)], VE, ["softmax", "input 0 dim 1", "[S(1)] -> [R]"]),
        ("cumsum", lambda a: torch.cumsum(a, 1), [(x, S1)], VE, ["cumsum", "input 0 dim 1", "[S(1)] -> [R]"]),
        ("sort", lambda a: torch.sort(a, dim=1).values, [(x, S1)], VE, ["sort", "input 0 dim 1", "[S(1)] ->"]),
        ("topk", lambda a: a.topk(3, dim=1).values, [(x, S1)], VE, ["topk", "input 0 dim 1", "[S(1)] ->"]),
        ("unbind", lambda a: torch.unbind(a, 0), [(x, S0)], VE, ["unbind", "input 0 dim 0", "[S(0)] ->"]),
        ("split", lambda a: torch.split(a, [1, 3], dim=0), [(x, S0)], VE, ["split", "input 0 dim 0", "[S(0)] ->"]),
        ("layer_norm", lambda a, ww, bb: F.layer_norm(a, (6,), ww, bb), [(x, S1), (w, R), (b, R)], VE,
         ["layer_norm", "input 0 dim 1", "[S(1)] -> [R]"]),
        ("expand", lambda a: a.expand(3, 6), [(row, S0)], VE, ["expand", "input 0 dim 0", "[S(0)] -> [R]"]),
        ("pad", lambda a: F.pad(a, (1, 2)), [(x, S1)], VE, ["pad", "input 0 dim 1", "[S(1)] -> [R]"]),
        ("scatter", lambda a, i, s: torch.scatter(a, 1, i, s), [(x, S0), (idx, S0, False), (src, S1)], VE,
         ["scatter", "input 2 dim 1", "[S(1)] -> [S(0)]", "input 1: [S(0)]"]),
        ("masked_scatter", lambda a, s: a.masked_scatter(mask, s), [(x, S0), (flat, R)], VE,
         ["masked_scatter", "input 0 dim 0", "[S(0)] -> [R]"]),
        ("isin", lambda e, t: torch.isin(e, t), [(elems, S0, False), (tests_, S0, False)], VE,
         ["isin", "input 1 dim 0", "[S(0)] -> [R]"]),
        ("sdpa kv seq", lambda a, kk, vv: sdpa(a, kk, vv), [(q, S2), (k, S2), (v, S2)], NIE,
         ["scaled_dot_product_attention", "input 1 dim 2", "[S(2)] -> [R]", "ring attention"]),
        ("sdpa embedding dim", lambda a, kk, vv: sdpa(a, kk, vv), [(q, [Shard(3)]), (k, R), (v, R)], NIE,
         ["scaled_dot_product_attention", "input 0 dim 3", "[S(3)] -> [R]", "ring attention"]),
        ("sdpa mismatch", lambda a, kk, vv: sdpa(a, kk, vv), [(q, S1), (k, S0), (v, S0)], VE,
         ["scaled_dot_product_attention", "input 0 dim 1", "moved from mesh dim 'tp' to dim 0", "[S(1)] -> [S(0)]"]),
        ("squeeze sharded singleton", lambda a: a.squeeze(0), [(row, S0)], VE,
         ["squeeze", "input 0 dim 0", "[S(0)] -> [R]"]),
        ("squeeze non-singleton", lambda a: a.squeeze(0), [(x, S1)], VE,
         ["squeeze of dim 0 of size 4", "[S(1)]", "not a singleton"]),
    ]


def _make(t, mesh, pl, rg):
    d = hp.distribute_tensor(t.detach(), mesh, pl)
    return d.requires_grad_() if rg else d


def _strict_body():
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    n = 0
    for label, f, inputs, exc, parts in _cases():
        specs = [(s[0], s[1], s[2] if len(s) > 2 else True) for s in inputs]
        for attempt in range(2):   # the second call is a cache hit: it raises again
            dts = [_make(t, mesh, pl, rg) for t, pl, rg in specs]
            with hp.strict_layouts(), hp.CommDebugMode() as comm:
                with pytest.raises(exc) as ei:
                    f(*dts)
            assert comm.get_total_counts() == 0, (label, comm.get_comm_counts())   # raised before any move
            msg = str(ei.value)
            assert isinstance(ei.value, hp.StrictLayoutError), (label, type(ei.value))
            assert (exc is NIE) == isinstance(ei.value, StrictLayoutNotImplementedError), label
            for p in parts:
                assert p in msg, (label, p, msg)
        # without the switch (the default): PyTorch's behaviour, values and gradients equal one process
        assert modes.strict_layouts_mode() == "off"
        _check(label, mesh, f, [(t, pl, rg) for t, pl, rg in specs])
        n += 1
    return n


def test_every_hyperparallel_case_raises_under_strict_and_matches_one_process_without(dist_runner):
    assert dist_runner.run(2, _strict_body) == [len(_cases())] * 2


def _multinomial_body():
    """multinomial draws from the DTensor RNG: parity through a draw that is determined (k of k nonzero)."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    probs = torch.zeros(4, 6, dtype=torch.float64)
    for r in range(4):
        probs[r, [r % 3, 3 + r % 2, 5]] = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    d = hp.distribute_tensor(probs, mesh, S1)
    with hp.strict_layouts():
        with pytest.raises(ValueError) as ei:
            torch.multinomial(d, 3)
    msg = str(ei.value)
    assert "multinomial" in msg and "input 0 dim 1" in msg and "[S(1)] -> [R]" in msg, msg
    out = torch.multinomial(d, 3)                   # default: the probability dim is gathered
    ref = (probs > 0).nonzero()[:, 1].view(4, 3)
    torch.testing.assert_close(out.full_tensor().sort(dim=1).values, ref)
    # rows sharded: no redistribution, fine under strict mode too
    with hp.strict_layouts():
        out = torch.multinomial(hp.distribute_tensor(probs, mesh, S0), 3)
    torch.testing.assert_close(out.full_tensor().sort(dim=1).values, ref)
    return True


def test_multinomial(dist_runner):
    assert dist_runner.run(2, _multinomial_body) == [True] * 2


def _not_implicit_body():
    """What strict mode lets through: layouts that need no move, local splits, Partial reductions."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = _randn(4, 6)
    with hp.strict_layouts():
        a = hp.distribute_tensor(x, mesh, S0)
        torch.testing.assert_close(a.softmax(-1).full_tensor(), x.softmax(-1))        # dim 1 not sharded
        r = hp.distribute_tensor(x, mesh, R)
        torch.testing.assert_close((a + r).full_tensor(), 2 * x)                     # R -> S(0): local split
        p = hp.DTensor.from_local(x * (dist.get_rank() + 1) / 3, mesh, [Partial()])
        torch.testing.assert_close(p.softmax(-1).full_tensor(), x.softmax(-1))       # P -> R: pending reduction
        torch.testing.assert_close(a.unsqueeze(0).squeeze(0).full_tensor(), x)       # singleton dim: fine
        sq = hp.distribute_tensor(x.unsqueeze(0), mesh, S1).squeeze()                 # no dim: only size-1 dims
        torch.testing.assert_close(sq.full_tensor(), x)
        q = hp.distribute_tensor(_randn(2, 2, 8, 4, seed=1), mesh, S2)              # sequence-parallel queries
        kv = hp.distribute_tensor(_randn(2, 2, 8, 4, seed=2), mesh, R)              # whole K/V: supported
        out = F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
        ref = F.scaled_dot_product_attention(q.full_tensor(), kv.full_tensor(), kv.full_tensor(), is_causal=True)
        torch.testing.assert_close(out.full_tensor(), ref)
        # the old strict mode's case: S(0) + S(1) moves a shard -> still refused, still a RuntimeError
        c = hp.distribute_tensor(x, mesh, S1)
        with pytest.raises(RuntimeError) as ei:
            a + c
        assert "input 1 dim 1 (moved from mesh dim 'tp' to dim 0: [S(1)] -> [S(0)])" in str(ei.value), str(ei.value)
    return True


def test_local_splits_and_partial_reductions_are_not_implicit(dist_runner):
    assert dist_runner.run(2, _not_implicit_body) == [True] * 2


def _switch_body():
    """Global setter, context manager (nested, restored on error), fast-path entries, bad arguments."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = _randn(4, 6)
    a = hp.distribute_tensor(x, mesh, S1)
    for _ in range(3):   # warm every cache (a non-singleton squeeze is a no-op: it would be a fast-path hit)
        a.softmax(-1)
        a.squeeze(0)
    hp.strict_layouts(True)                                   # global setter
    assert modes.strict_layouts_mode() == "strict"
    with pytest.raises(ValueError, match="softmax"):
        a.softmax(-1)
    with pytest.raises(ValueError, match="squeeze"):
        a.squeeze(0)
    with hp.strict_layouts(False):                            # nested: off inside, strict again after
        torch.testing.assert_close(a.softmax(-1).full_tensor(), x.softmax(-1))
    with pytest.raises(ValueError, match="softmax"):
        a.softmax(-1)
    hp.strict_layouts(False)
    assert modes.strict_layouts_mode() == "off"
    torch.testing.assert_close(a.softmax(-1).full_tensor(), x.softmax(-1))
    hp.set_strict_layouts(True)                               # the older spelling
    assert modes.strict_layouts_mode() == "strict"
    hp.set_strict_layouts(False)
    try:
        with hp.strict_layouts():
            raise KeyError("boom")
    except KeyError:
        pass
    assert modes.strict_layouts_mode() == "off"               # restored on an exception
    for bad, kw in (("yes", {}), (None, {}), (True, {"warn_only": "no"})):
        with pytest.raises(TypeError) as ei:
            hp.strict_layouts(bad, **kw)
        name = "warn_only" if kw else "enabled"
        assert name in str(ei.value) and "bool" in str(ei.value), str(ei.value)
    assert modes.strict_layouts_mode() == "off"
    return True


def test_switch_forms(dist_runner):
    assert dist_runner.run(2, _switch_body) == [True] * 2


def _warn_only_body():
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = _randn(4, 6)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with hp.strict_layouts(warn_only=True):
            for _ in range(3):
                a = hp.distribute_tensor(x, mesh, S1).requires_grad_()
                y = a.softmax(-1)                               # runs, and warns the first time only
                torch.testing.assert_close(y.full_tensor(), x.softmax(-1))
            torch.cumsum(a, 1)                                  # another op: one more warning
            torch.cumsum(a, 1)
            a.squeeze(0)                                        # semantic case: warned, nothing moved
            hp.distribute_tensor(x, mesh, S0).softmax(-1)       # nothing implicit: no warning
    got = [w for w in rec if issubclass(w.category, modes.ImplicitRedistributionWarning)]
    msgs = [str(w.message) for w in got]
    assert len(got) == 3, msgs
    # all_gather of the (4, 6) fp64 tensor's dim 1 on 2 ranks: each rank sends its (4, 3) piece once
    assert "softmax" in msgs[0] and "input 0 dim 1" in msgs[0] and "[S(1)] -> [R]" in msgs[0], msgs[0]
    assert "96 bytes" in msgs[0], msgs[0]
    assert "cumsum" in msgs[1] and "96 bytes" in msgs[1], msgs[1]
    assert "squeeze" in msgs[2] and "no data moved" in msgs[2], msgs[2]
    return True


def test_warn_only(dist_runner):
    assert dist_runner.run(2, _warn_only_body) == [True] * 2


def _env_body():
    """The environment variable selects the initial mode (read at import; _reset re-reads it)."""
    old = os.environ.get(modes.ENV_VAR)
    try:
        os.environ[modes.ENV_VAR] = "1"
        modes._reset()
        a = hp.distribute_tensor(_randn(4, 6), hp.init_device_mesh("cpu", (2,)), S1)
        with pytest.raises(ValueError, match="strict layouts: softmax"):
            a.softmax(-1)
        os.environ[modes.ENV_VAR] = "warn"
        modes._reset()
        with pytest.warns(modes.ImplicitRedistributionWarning, match="bytes"):
            a.softmax(-1)
    finally:
        if old is None:
            os.environ.pop(modes.ENV_VAR, None)
        else:
            os.environ[modes.ENV_VAR] = old
        modes._reset()
    return modes.strict_layouts_mode()


def test_env_variable_in_workers(dist_runner):
    assert dist_runner.run(2, _env_body) == ["off"] * 2


def test_env_variable_parsing_and_import():
    env = modes._mode_from_env
    assert env({}) == modes.OFF and env({"HYPER_PARALLEL_STRICT_LAYOUTS": "0"}) == modes.OFF
    assert env({"HYPER_PARALLEL_STRICT_LAYOUTS": "1"}) == modes.STRICT
    assert env({"HYPER_PARALLEL_STRICT_LAYOUTS": " True "}) == modes.STRICT
    assert env({"HYPER_PARALLEL_STRICT_LAYOUTS": "warn"}) == modes.WARN
    with pytest.raises(ValueError) as ei:
        env({"HYPER_PARALLEL_STRICT_LAYOUTS": "maybe"})
    assert "HYPER_PARALLEL_STRICT_LAYOUTS='maybe'" in str(ei.value) and "warn" in str(ei.value)
    code = "from hyper_parallel.core.shard import modes; print(modes.strict_layouts_mode())"
    for value, mode in (("1", "strict"), ("warn", "warn"), ("", "off")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "HYPER_PARALLEL_STRICT_LAYOUTS": value})
        assert out.stdout.strip() == mode, (value, out.stdout, out.stderr)


def _default_pytorch_body():
    """Default mode on PyTorch's and HyperParallel's paths: implicit redistributions run, no warning."""
    from hyper_parallel import device_mesh as torch_paths
    from hyper_parallel.core.dtensor import device_mesh as hp_paths
    x = _randn(4, 6)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for mesh in (torch_paths.init_device_mesh("cpu", (2,)), hp_paths.init_device_mesh("cpu", (2,))):
            a = hp.distribute_tensor(x, mesh, S1)
            torch.testing.assert_close(a.softmax(-1).full_tensor(), x.softmax(-1))
            torch.testing.assert_close(a.squeeze(0).full_tensor(), x.squeeze(0))
            torch.testing.assert_close(torch.cumsum(a, 1).full_tensor(), torch.cumsum(x, 1))
    assert not [w for w in rec if issubclass(w.category, modes.ImplicitRedistributionWarning)]
    return modes.strict_layouts_mode()


def test_default_is_pytorch_behaviour(dist_runner):
    assert os.environ.get("HYPER_PARALLEL_STRICT_LAYOUTS", "") in ("", "0")
    assert dist_runner.run(2, _default_pytorch_body) == ["off"] * 2


def _mesh2d_body():
    """(2, 2) mesh: the dim and the mesh dim names in the message; a shard moved across tensor dims."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = _randn(4, 6)
    a = hp.distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    with hp.strict_layouts():
        with pytest.raises(ValueError) as ei:
            a.softmax(-1)
        msg = str(ei.value)
        assert "input 0 dim 1 (gathered over mesh dim 'tp': [S(0), S(1)] -> [S(0), R])" in msg, msg
        assert "dim 0" not in msg.split("(inputs:")[0], msg                    # the dp shard stays
        with pytest.raises(ValueError) as ei:
            a.softmax(0)
        assert "input 0 dim 0 (gathered over mesh dim 'dp'" in str(ei.value), str(ei.value)
    _check("softmax 2d", mesh, lambda t: t.softmax(-1), [(x, [Shard(0), Shard(1)])])
    _check("softmax 2d dim 0", mesh, lambda t: t.softmax(0), [(x, [Shard(0), Shard(1)])])
    return True


def test_2d_mesh(dist_runner):
    assert dist_runner.run(4, _mesh2d_body) == [True] * 4
