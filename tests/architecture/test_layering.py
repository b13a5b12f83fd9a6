"""The public hooks between packages (issue 22): one home for the switches, checked hook arguments.

The hooks that replaced writes into private tables (``register`` / ``override``,
``register_special``, ``set_dispatcher``, ``provide_dtensor_names``, ``register_export``)
are exercised on real DTensors (2 ranks). The import layers and the absence of import cycles
are checked by ``tests/architecture/test_architecture.py`` (import-linter contracts and grimp).
"""
from __future__ import annotations


import pytest
import torch

import hyper_parallel
from hyper_parallel import Replicate, Shard



def test_public_homes_are_the_same_objects():
    from hyper_parallel.core.dtensor import dtensor
    from hyper_parallel.dtensor import skip_and_replication
    from hyper_parallel.core.shard import _op_dispatch
    from hyper_parallel.dispatch import dispatcher
    from hyper_parallel.dispatch import modes
    for name in ("add_no_skip_ops", "remove_no_skip_ops", "get_no_skip_ops",
                 "disable_dtensor_dispatch", "enable_dtensor_dispatch", "get_dtensor_dispatch"):
        assert getattr(modes, name) is getattr(skip_and_replication, name) is getattr(_op_dispatch, name), name
    assert modes.implicit_replication is skip_and_replication.implicit_replication
    assert modes.SkipDTensorDispatch is dtensor.SkipDTensorDispatch \
        is hyper_parallel.SkipDTensorDispatch
    assert hyper_parallel.implicit_replication is modes.implicit_replication
    assert hyper_parallel.allow_replicate_fallback is modes.allow_replicate_fallback
    assert _op_dispatch.OpDispatcher is dispatcher.OpDispatcher
    assert _op_dispatch._OP_DISPATCHER is dispatcher._RULE_DISPATCHER  # HyperParallel's instance name
    assert _op_dispatch.get_dtensor_dispatch()
    with hyper_parallel.SkipDTensorDispatch():
        assert not _op_dispatch.get_dtensor_dispatch()
    for own_private in ("_CACHE", "_FAST", "_STATS", "_handle", "_signature"):  # not HyperParallel's names
        assert not hasattr(_op_dispatch, own_private), own_private
    assert dtensor.distribute_tensor is hyper_parallel.distribute_tensor
    import hyper_parallel.core.dtensor as pkg
    assert pkg.CommDebugMode is hyper_parallel.CommDebugMode


def test_hook_arguments_are_checked():
    from hyper_parallel.core.dtensor import dtensor, register_export
    from hyper_parallel.dtensor import hp_module_names as _hp_compat
    from hyper_parallel.dispatch import modes
    from hyper_parallel.dispatch.rules import base
    with pytest.raises(TypeError, match="set_dispatcher: dispatcher must have a callable 'torch_function', got 3"):
        dtensor.set_dispatcher(3)
    with pytest.raises(ValueError, match="set_mode: mode must be 'eager' or 'compile', got 'jit'"):
        dtensor.set_mode("jit")
    with pytest.raises(TypeError, match="register_special: handler must be callable, got 'x'"):
        dtensor.register_special(torch.Tensor.add, "x")
    with pytest.raises(ValueError, match=r"provide_dtensor_names: \['nope'\] are not HyperParallel"):
        _hp_compat.provide_dtensor_names(nope=1)
    with pytest.raises(ValueError, match="register_export: 'nope' is not one of"):
        register_export("nope", 1)
    with pytest.raises(TypeError, match="override: name must be a non-empty op name string, got 3"):
        base.override(3, None)
    with pytest.raises(TypeError, match="register: rule must be a DistributedOp instance, got int"):
        base.register("mm", 3)
    with pytest.raises(TypeError, match="on_switch_change: callback must be callable"):
        modes.on_switch_change(None)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        dtensor.no_such_name  # noqa: B018


def _override_and_special():
    import hyper_parallel as hp
    from hyper_parallel.core.dtensor import dtensor as _dt
    from hyper_parallel.dispatch import dispatcher
    from hyper_parallel.dispatch.rules import base
    mesh = hp.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    a, b = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    da, db = hp.distribute_tensor(a, mesh, [Shard(1)]), hp.distribute_tensor(b, mesh, [Shard(0)])
    assert da.matmul(db).placements == (hp.Partial(),)  # the built-in rule: a pending sum

    class GatherFirst(base.DistributedOp):
        """mm by replicating both inputs first (a different, still correct plan)."""
        def strategy(self, call):
            rep = [lay.replicated() for lay in call.layouts]
            return base.Strategy(rep, rep[0])

    builtin = base.get_rule("matmul")
    rule = GatherFirst("matmul", register=False)
    assert base.get_rule("matmul") is builtin  # built, not registered
    with base.override("matmul", rule) as h:
        assert base.get_rule("matmul") is h.op and h.previous is builtin
        out = da.matmul(db)   # the caches were cleared: the override's plan runs
        assert out.placements == (Replicate(),)
        torch.testing.assert_close(out.to_local(), a @ b, rtol=0, atol=1e-12)
    assert base.get_rule("matmul") is builtin
    out = da.matmul(db)
    assert out.placements == (hp.Partial(),)
    torch.testing.assert_close(out.full_tensor(), a @ b, rtol=0, atol=1e-12)
    h.undo()  # a second undo is a no-op
    assert base.get_rule("matmul") is builtin

    # register_special: runs before any rule, undone exactly
    calls = []
    prev = _dt.register_special(torch.Tensor.exp, lambda x: calls.append(x) or "special")
    try:
        assert prev is None and da.exp() == "special" and calls == [da]
        assert dispatcher.handle(torch.Tensor.exp, (da,)) == "special"
    finally:
        _dt.unregister_special(torch.Tensor.exp, prev)
    e = da.exp()
    torch.testing.assert_close(e.full_tensor(), a.exp(), rtol=0, atol=0)
    assert len(calls) == 2
    return True


def test_override_and_register_special(dist_runner):
    assert dist_runner.run(2, _override_and_special) == [True, True]
