"""torch.compile on DTensor programs (issue 14): compiled == eager == one process, no graph breaks.

One distributed task on 2 ranks (compiling is slow: ``aot_eager``, tiny shapes, few graphs):

* a TP MLP (Colwise -> GELU -> Rowwise -> LayerNorm) compiled with ``fullgraph=True``: output and
  parameter gradients equal eager and one process for 3 SGD steps; no recompilation after step 1;
* an eagerly computed non-leaf DTensor that requires grad fed into a compiled block (per-block
  compile's embedding -> block boundary): values and gradients back to the leaf;
* a plain DTensor program (matmul, sum/mean/amax, redistribute Shard -> Replicate and Partial ->
  Replicate, ``full_tensor``) compiled with ``fullgraph=True`` on DTensor leaves: values and grads;
* the example Llama through ``train.py``'s ``train(..., --compile)`` (per-block compile, TP+SP) for 3
  steps: every loss equals one process; with ``loss_parallel`` (DTensor logits, eager loss) as well;
* ``replicate`` (dp=2) around compiled blocks: losses equal one process (the dp averaging
  hooks on the local tensors see the compiled backward's gradients);
* ``fully_shard`` (dp_shard=2) per block and root, then per-block compile: FSDP's hooks run
  eagerly (``eager_hook``), losses equal one process for 3 steps, one graph per block (no recompile);
  on 4 ranks the same with TP+SP inside (FSDP x TP).

Graph breaks are counted with ``torch._dynamo.utils.counters["graph_break"]`` across everything.
"""
import argparse
import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import ColwiseParallel, Partial, Replicate, RowwiseParallel, Shard, parallelize_module
from hyper_parallel.compile import compile_mode

TOL = dict(rtol=1e-5, atol=1e-5)
BACKEND = "aot_eager"


class _MLP(nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.w1, self.w2, self.ln = nn.Linear(d, h), nn.Linear(h, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(self.w2(F.gelu(self.w1(x))))


def _grads(mod):
    return {n: (p.grad.full_tensor() if isinstance(p.grad, hp.DTensor) else p.grad).clone()
            for n, p in mod.named_parameters()}


def _mlp_case(mesh):
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    ref = _MLP()
    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    eager = parallelize_module(copy.deepcopy(ref), mesh, plan)
    comp_mod = parallelize_module(copy.deepcopy(ref), mesh, plan)
    comp = torch.compile(comp_mod, backend=BACKEND, fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, eager, comp_mod)]
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        outs = []
        for m, f in ((ref, ref), (eager, eager), (comp_mod, comp)):
            y = f(x)
            (y * torch.linspace(-1, 1, 16)).sum().backward()
            outs.append(y.detach())
        torch.testing.assert_close(outs[1], outs[0], **TOL)
        torch.testing.assert_close(outs[2], outs[1], **TOL)
        g_ref, g_eager, g_comp = _grads(ref), _grads(eager), _grads(comp_mod)
        for n in g_ref:
            torch.testing.assert_close(g_eager[n], g_ref[n], **TOL, msg=n)
            torch.testing.assert_close(g_comp[n], g_eager[n], **TOL, msg=n)
        for o in opts:  # the optimizer step on DTensor parameters after a compiled forward/backward
            o.step()
            o.zero_grad(set_to_none=True)
        if step == 0:
            frames = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == frames, "steps 2 and 3 recompiled"
    for (n, p), (_, r) in zip(comp_mod.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor() if isinstance(p, hp.DTensor) else p.detach(), r.detach(), **TOL, msg=n)


def _program(a, b):
    c = a @ b                                        # Shard(0) @ Replicate -> Shard(0)
    s = c.sum(dim=0)                                 # -> Partial
    r = s.redistribute(s.device_mesh, [Replicate()])  # Partial -> Replicate (all_reduce)
    g = c.redistribute(c.device_mesh, [Replicate()])  # Shard -> Replicate (all_gather)
    m = (g * 2).mean() + c.amax()
    return r.full_tensor() * m.full_tensor() + g.full_tensor()[0]


def _program_case(mesh):
    torch.manual_seed(1)
    a_full, b_full = torch.randn(6, 5), torch.randn(5, 3)
    a_ref, b_ref = a_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    out_ref = _program_ref(a_ref, b_ref)
    out_ref.pow(2).sum().backward()
    for fn in (_program, torch.compile(_program, backend=BACKEND, fullgraph=True)):
        a = hp.distribute_tensor(a_full, mesh, [Shard(0)]).requires_grad_()
        b = hp.distribute_tensor(b_full, mesh, [Replicate()]).requires_grad_()
        out = fn(a, b)
        torch.testing.assert_close(out, out_ref.detach(), **TOL)
        out.pow(2).sum().backward()
        torch.testing.assert_close(a.grad.full_tensor(), a_ref.grad, **TOL)
        torch.testing.assert_close(b.grad.full_tensor(), b_ref.grad, **TOL)
        assert a.grad.placements == (Shard(0),) and b.grad.placements == (Replicate(),)
    # a DTensor returned by a region is used eagerly: its gradient crosses the boundary (the
    # function bridge runs AOT's autograd.Function on the local tensors)
    a = hp.distribute_tensor(a_full, mesh, [Shard(0)]).requires_grad_()
    f = torch.compile(lambda t: (t * 3).sin(), backend=BACKEND, fullgraph=True)
    out = f(a)
    assert isinstance(out, hp.DTensor) and out.placements == (Shard(0),)
    (out * 2).full_tensor().sum().backward()
    torch.testing.assert_close(a.grad.full_tensor(), 6 * torch.cos(3 * a_full), **TOL)
    # an eagerly computed DTensor that requires grad (non-leaf: an embedding/activation) fed to a
    # compiled block, as in per-block compile: gradients flow through the region back to the leaf
    w = hp.distribute_tensor(a_full, mesh, [Shard(0)]).requires_grad_()
    blk = torch.compile(lambda t, u: (t * 3).sin() @ u, backend=BACKEND, fullgraph=True)
    for step in range(2):  # the second call reuses the graph (no recompile for non-leaf inputs)
        act = w * 2
        assert not act.is_leaf and act.requires_grad
        out = blk(act, b)
        out.full_tensor().pow(2).sum().backward()
    w_ref, b_ref2 = a_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    for step in range(2):
        ((w_ref * 2 * 3).sin() @ b_ref2).pow(2).sum().backward()
    torch.testing.assert_close(w.grad.full_tensor(), w_ref.grad, **TOL)
    torch.testing.assert_close(b.grad.full_tensor(), b_ref2.grad + b_ref.grad, **TOL)
    # Partial input made inside the region, reduced by full_tensor
    f = torch.compile(lambda x: hp.DTensor.from_local(x, mesh, [Partial()]).full_tensor() * 3,
                      backend=BACKEND, fullgraph=True)
    x = torch.full((2, 2), float(dist.get_rank() + 1), requires_grad=True)
    y = f(x)
    torch.testing.assert_close(y, torch.full((2, 2), 3.0 * sum(range(1, dist.get_world_size() + 1))))
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 2), 3.0))


def _program_ref(a, b):
    c = a @ b
    return c.sum(dim=0) * ((c * 2).mean() + c.amax()) + c[0]


def _llama_case(dp, tp, sp, loss_parallel, cfg, dp_shard=1):
    from examples.llama.reference import train_reference
    from examples.llama.train import train
    if dp_shard > 1:
        mesh = hp.init_device_mesh("cpu", (dp, dp_shard, tp), mesh_dim_names=("dp", "dp_shard", "tp"))
    else:
        mesh = hp.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    args = argparse.Namespace(sp=sp, loss_parallel=loss_parallel, compile=BACKEND, dp_shard=dp_shard)
    losses = train(args, 3, cfg, mesh, log=lambda *a: None)
    ref, _ = train_reference(cfg.model, 3, seed=cfg.seed, global_batch=cfg.global_batch, seq_len=cfg.seq_len,
                             optim=cfg.optim)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)


def _task():
    import torch._dynamo
    from torch._dynamo.utils import counters
    from examples.llama.configs import get_config
    from examples.llama.model import ModelArgs
    torch._dynamo.reset()
    counters.clear()
    try:
        mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        _mlp_case(mesh)
        _program_case(mesh)
        small = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=260, multiple_of=32,
                          max_seq_len=16)
        cfg = dataclasses.replace(get_config("tiny"), model=small, global_batch=4, seq_len=16)
        _llama_case(1, 2, True, False, cfg)     # TP+SP, per-block compile (the example's --compile)
        _llama_case(1, 2, True, True, cfg)      # + loss_parallel
        _llama_case(2, 1, False, False, cfg)    # replicate (dp=2) around compiled blocks
        # fully_shard each block and the root, then compile each block (torchtitan order): FSDP's
        # hooks stay eager, the block bodies compile with fullgraph=True; no recompile after step 1
        graphs = counters["stats"]["unique_graphs"]
        _llama_case(1, 1, False, False, cfg, dp_shard=2)
        fsdp_graphs = counters["stats"]["unique_graphs"] - graphs
        assert 1 <= fsdp_graphs <= 2, f"FSDP blocks compiled {fsdp_graphs} graphs for 2 blocks (recompiles)"
        breaks = dict(counters["graph_break"])
        assert not breaks, f"graph breaks: {breaks}"
        return dict(counters["stats"])
    finally:
        compile_mode.restore_eager_fast_paths()  # leave the pool's worker as found


def _task_fsdp_tp():
    """FSDP x TP (dp_shard=2, tp=2, SP) with per-block compile: losses equal one process, no breaks."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from examples.llama.configs import get_config
    from examples.llama.model import ModelArgs
    torch._dynamo.reset()
    counters.clear()
    try:
        small = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=260, multiple_of=32,
                          max_seq_len=16)
        cfg = dataclasses.replace(get_config("tiny"), model=small, global_batch=4, seq_len=16)
        _llama_case(1, 2, True, False, cfg, dp_shard=2)
        assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
        assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    finally:
        compile_mode.restore_eager_fast_paths()


def test_compile_fsdp_tp_four_ranks(dist_runner):
    dist_runner.run(4, _task_fsdp_tp, timeout=400)


def test_compile_parity_two_ranks(dist_runner):
    stats = dist_runner.run(2, _task, timeout=400)
    assert stats[0]["unique_graphs"] >= 3


def test_compile_mode_restores_fast_methods():
    """Compile mode removes the eager fast methods (dynamo cannot inline them); the reset puts them back."""
    from hyper_parallel.dtensor import fast_path as _fast_methods
    cs = compile_mode
    assert all(n in hp.DTensor.__dict__ for n in _fast_methods.METHODS if hasattr(torch.Tensor, n))
    from hyper_parallel.dispatch.dispatcher import ENTRY
    eager = {n: hp.DTensor.__dict__[n] for n in ("to_local", "redistribute")}
    entry, eager_tf = hp.DTensor.__dict__["__torch_function__"], ENTRY.torch_function
    cs._enter_compile_mode()
    assert cs.in_compile_mode() and "__add__" not in hp.DTensor.__dict__ and "size" not in hp.DTensor.__dict__
    assert all(hp.DTensor.__dict__[n] is not f for n, f in eager.items())  # dynamo branches installed
    # compile is the dispatcher's mode: the class's entry point is the same object, the dispatcher's is not
    assert ENTRY.mode == "compile" and ENTRY.torch_function is not eager_tf
    assert hp.DTensor.__dict__["__torch_function__"] is entry
    cs.restore_eager_fast_paths()
    assert not cs.in_compile_mode() and "__add__" in hp.DTensor.__dict__ and "size" in hp.DTensor.__dict__
    assert all(hp.DTensor.__dict__[n] is f for n, f in eager.items())
    assert ENTRY.mode == "eager" and ENTRY.torch_function is eager_tf
    assert hp.DTensor.__dict__["__torch_function__"] is entry
