"""Selective activation checkpointing (hyper_parallel.auto.selective_ac): what it recomputes, what the planner
predicts for it and what a step measures (dry run of one rank; tests/auto/test_dry_run.py ties the dry run to
real gloo ranks, tests/auto/test_apply_memory.py checks training parity)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from examples.llama.configs import get_config
from examples.llama.model import Transformer, build_model, loss_fn
from hyper_parallel.auto import Cluster, dry_run, evaluate_plan, plan
from hyper_parallel.auto.selective_ac import checkpoint_selective


class _CountMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.mm += 1
        return func(*args, **(kwargs or {}))


def _backward_mms(ac):
    cfg = get_config("tiny")
    model = build_model(cfg.model, cfg.seed).double()
    for block in model.layers.values():
        if ac == "selective":
            checkpoint_selective(block)
        elif ac == "full":
            from functools import partial
            from torch.utils.checkpoint import checkpoint
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    loss = loss_fn(model(x), x)
    with _CountMM() as c:
        loss.backward()
    return c.mm, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_selective_ac_recomputes_no_matmul_and_keeps_gradients():
    none, l0, g0 = _backward_mms("none")
    sel, l1, g1 = _backward_mms("selective")
    full, l2, _ = _backward_mms("full")
    assert sel == none < full, (none, sel, full)  # full AC redoes the forward matmuls, selective none of them
    assert l0 == l1 == l2
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=0, atol=0)


@pytest.mark.parametrize("name,deg,sp", [("demo", {"fsdp": 4}, False), ("demo", {"fsdp": 2, "tp": 2}, True),
                                         ("moe-demo", {"fsdp": 4, "ep": 2}, False)])
def test_selective_ac_memory_prediction_vs_measured(name, deg, sp):
    cfg = get_config(name)
    with torch.device("meta"):
        m = Transformer(cfg.model, init_seed=None)
    got = {}
    for ac in ("none", "full", "selective"):
        p = evaluate_plan(m, Cluster(4, 4, "1GiB"), degrees=deg, global_batch=cfg.global_batch, seq_len=cfg.seq_len,
                          sequence_parallel=sp, activation_checkpointing=ac)
        peak = dry_run(p, lambda: build_model(cfg.model, cfg.seed), world_size=4, rank=0).ranks[0].peak_memory
        got[ac] = (p.memory.total, peak)
    for ac, (pred, peak) in got.items():
        assert abs(pred - peak) <= 0.10 * peak, (ac, pred, peak)
    # selective sits between none and full, measured and predicted
    assert got["full"][1] < got["selective"][1] < got["none"][1], got
    assert got["full"][0] < got["selective"][0] < got["none"][0], got


def test_plan_searches_selective_ac():
    cfg = get_config("demo")
    with torch.device("meta"):
        m = Transformer(cfg.model, init_seed=None)
    plans = plan(m, Cluster(4, 4, "1GiB"), global_batch=cfg.global_batch, seq_len=cfg.seq_len, top_k=10**6)
    assert {p.activation_checkpointing for p in plans} == {"none", "full", "selective"}
    sel = plan(m, Cluster(4, 4, "1GiB"), global_batch=cfg.global_batch, seq_len=cfg.seq_len,
               activation_checkpointing="selective")
    assert all(p.activation_checkpointing == "selective" for p in sel)
