"""Optimizers on DTensor parameters: training equals single-process training.

Every case trains the same model twice, on DTensor parameters and on plain parameters in one
process, and compares the loss and the clip norm every step, the parameters and the optimizer
state at the end (fp32, 1e-5). The MLP matrix also checkpoints module + optimizer state at step 5,
loads it into a freshly built model and optimizer and checks that training continues identically.
"""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard
from tests.harness.parity import _make

TOL = dict(rtol=1e-5, atol=1e-5)
STEPS, RESUME_AT = 10, 5

# {SGD(momentum), Adam, AdamW} x {foreach, for-loop}; each case also gets one clip_grad_norm_
# configuration, so that every (foreach, norm_type) pair is met once per world size.
OPT_CASES = [(o, fe) for o in ("sgd", "adam", "adamw") for fe in (True, False)]
CLIP_CASES = [(False, 2.0), (True, math.inf), (False, 1.0), (True, 2.0), (False, math.inf), (True, 1.0)]
CASES = [(o, fe, cfe, nt) for (o, fe), (cfe, nt) in zip(OPT_CASES, CLIP_CASES)]
assert sorted((c, n) for _, _, c, n in CASES) == sorted((c, n) for c in (False, True) for n in (1.0, 2.0, math.inf))


def _make_opt(opt_name, foreach, params):
    if opt_name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=1e-2, foreach=foreach)
    if opt_name == "adam":
        return torch.optim.Adam(params, lr=1e-2, foreach=foreach)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=foreach)


class MLP(nn.Module):
    def __init__(self, d=8, h=16):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(self.norm(x))))


def _pl(mesh, tp_dim, shard_dim):
    return [Shard(shard_dim) if d == tp_dim else Replicate() for d in range(mesh.ndim)]


def _shard_mlp(model, mesh):
    tp = mesh.ndim - 1

    def partition(name, mod, m):
        if name == "fc1":
            mod.weight = nn.Parameter(hp.distribute_tensor(mod.weight.data, m, _pl(m, tp, 0)))
            mod.bias = nn.Parameter(hp.distribute_tensor(mod.bias.data, m, _pl(m, tp, 0)))
        elif name == "fc2":
            mod.weight = nn.Parameter(hp.distribute_tensor(mod.weight.data, m, _pl(m, tp, 1)))
    return hp.distribute_module(model, mesh, partition)


def _batch_pl(mesh):
    """Batch sharded over the data-parallel dim of a 2-D mesh, replicated on a 1-D (TP-only) mesh."""
    return [Shard(0), Replicate()] if mesh.ndim == 2 else [Replicate()]


def _ref_step(model, opt, x, y, clip, set_to_none, loss_fn):
    opt.zero_grad(set_to_none=set_to_none)
    loss = loss_fn(model(x), y)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), clip[0], norm_type=clip[2], foreach=clip[1])
    opt.step()
    return loss.detach(), norm


def _dt_step(model, opt, x, y, clip, set_to_none, loss_fn, mesh, x_pl):
    opt.zero_grad(set_to_none=set_to_none)
    for n, p in model.named_parameters():
        if set_to_none:
            assert p.grad is None, f"{n}: grad not None after zero_grad(set_to_none=True)"
        elif p.grad is not None:  # zeroed in place, still a DTensor
            assert isinstance(p.grad, hp.DTensor), f"{n}: grad is {type(p.grad).__name__} after zero_grad(False)"
            assert not p.grad.to_local().any(), f"{n}: grad not zeroed by zero_grad(set_to_none=False)"
    dx = hp.distribute_tensor(x, mesh, x_pl)
    dy = hp.distribute_tensor(y, mesh, x_pl) if y is not None else None
    loss = loss_fn(model(dx), dy)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), clip[0], norm_type=clip[2], foreach=clip[1])
    opt.step()
    assert isinstance(norm, hp.DTensor) and all(p.is_replicate() for p in norm.placements), norm
    return loss.full_tensor(), norm.full_tensor()


def _check_params(model, ref, label):
    for (n, p), (rn, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert n == rn
        assert isinstance(p, hp.DTensor), f"{label}: {n} is {type(p).__name__}"
        torch.testing.assert_close(p.full_tensor(), r.detach(), **TOL, msg=f"{label}: param {n}")


def _check_opt_state(opt, model, opt_ref, ref, label):
    """Every state tensor of a DTensor parameter (except the scalar step) is a DTensor laid out like
    the parameter and equal to the single-process state."""
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        st, st_ref = opt.state[p], opt_ref.state[r]
        assert st and set(st) == set(st_ref), f"{label}: {n} state keys {sorted(st)} != {sorted(st_ref)}"
        for key, v in st.items():
            if key == "step" or (not isinstance(v, hp.DTensor) and torch.as_tensor(v).dim() == 0):
                # scalar state: the step count, NAdam's mu_product
                torch.testing.assert_close(torch.as_tensor(v), torch.as_tensor(st_ref[key]), msg=f"{label}: {n}.{key}")
                continue
            assert isinstance(v, hp.DTensor), f"{label}: {n}.{key} is {type(v).__name__}"
            assert v.device_mesh == p.device_mesh and tuple(v.placements) == tuple(p.placements), \
                f"{label}: {n}.{key} placements {v.placements} != param {p.placements}"
            torch.testing.assert_close(v.full_tensor(), st_ref[key], **TOL, msg=f"{label}: {n}.{key}")


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _train_matrix(mesh_shape):
    mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[-len(mesh_shape):])
    x_pl = _batch_pl(mesh)
    for opt_name, foreach, clip_foreach, norm_type in CASES:
        label = f"{mesh_shape} {opt_name} foreach={foreach} clip(foreach={clip_foreach}, norm_type={norm_type})"
        clip = (0.05, clip_foreach, norm_type)
        torch.manual_seed(0)
        ref = MLP()
        model = _shard_mlp(copy.deepcopy(ref), mesh)
        opt_ref, opt = _make_opt(opt_name, foreach, ref.parameters()), _make_opt(opt_name, foreach, model.parameters())
        data = [(torch.randn(12, 8), torch.randn(12, 8)) for _ in range(STEPS)]
        losses, clipped = [], False
        for step, (x, y) in enumerate(data):
            if step == RESUME_AT:  # the checkpoint: module and optimizer state, deep-copied
                sd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
                sd_params = {k: v.full_tensor() for k, v in sd.items()}
            set_to_none = step % 2 == 1  # both zero_grad flavours, in-place zeroing once grads exist
            loss_ref, norm_ref = _ref_step(ref, opt_ref, x, y, clip, set_to_none, _mse)
            loss, norm = _dt_step(model, opt, x, y, clip, set_to_none, _mse, mesh, x_pl)
            torch.testing.assert_close(loss, loss_ref, **TOL, msg=f"{label}: loss at step {step}")
            torch.testing.assert_close(norm, norm_ref, **TOL, msg=f"{label}: clip norm at step {step}")
            clipped |= bool(norm_ref > clip[0])
            losses.append(loss)
        assert clipped, f"{label}: max_norm never clipped"
        _check_params(model, ref, label)
        _check_opt_state(opt, model, opt_ref, ref, label)

        # resume: a freshly built (differently initialised) model and optimizer load the step-5 state
        assert all(isinstance(v, hp.DTensor) for v in sd.values()), label
        model2 = _shard_mlp(MLP(), mesh)
        model2.load_state_dict(sd)
        opt2 = _make_opt(opt_name, foreach, model2.parameters())
        opt2.load_state_dict(osd)
        for n, p in model2.named_parameters():
            torch.testing.assert_close(p.full_tensor(), sd_params[n], rtol=0, atol=0, msg=f"{label}: loaded {n}")
            for key, v in opt2.state[p].items():
                if key != "step":
                    assert isinstance(v, hp.DTensor) and tuple(v.placements) == tuple(p.placements), \
                        f"{label}: loaded {n}.{key}: {type(v).__name__} {getattr(v, 'placements', None)}"
        for step in range(RESUME_AT, STEPS):
            x, y = data[step]
            loss, _ = _dt_step(model2, opt2, x, y, clip, step % 2 == 1, _mse, mesh, x_pl)
            torch.testing.assert_close(loss, losses[step], rtol=1e-6, atol=1e-7, msg=f"{label}: resumed loss {step}")
        _check_params(model2, ref, label + " resumed")
        _check_opt_state(opt2, model2, opt_ref, ref, label + " resumed")


def test_optimizer_matrix_tp(dist_runner):
    dist_runner.run(2, _train_matrix, (2,))


def test_optimizer_matrix_dp_tp(dist_runner):
    dist_runner.run(4, _train_matrix, (2, 2))


# fused kernels (torch._fused_adam_/_fused_adamw_/_fused_sgd_/_fused_adagrad_) and the variants whose
# for-loop step writes with out= (amsgrad: torch.maximum(..., out=max_exp_avg_sq); Adamax)
MORE_OPTS = {
    "adamw fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adam fused amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, fused=True),
    "sgd fused nesterov": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, fused=True),
    "adagrad fused": lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True),
    "adamw amsgrad for-loop": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, foreach=False),
    "adamw amsgrad foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, foreach=True),
    "adamax for-loop": lambda p: torch.optim.Adamax(p, lr=1e-2, foreach=False),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
}


def _more_optimizers(mesh_shape):
    mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[-len(mesh_shape):])
    x_pl = _batch_pl(mesh)
    clip = (1e9, True, 2.0)  # no clipping: the fused/out= paths are what is tested here
    for label, make in MORE_OPTS.items():
        torch.manual_seed(0)
        ref = MLP()
        model = _shard_mlp(copy.deepcopy(ref), mesh)
        opt_ref, opt = make(ref.parameters()), make(model.parameters())
        for step in range(4):
            x, y = torch.randn(12, 8), torch.randn(12, 8)
            loss_ref, _ = _ref_step(ref, opt_ref, x, y, clip, True, _mse)
            loss, _ = _dt_step(model, opt, x, y, clip, True, _mse, mesh, x_pl)
            torch.testing.assert_close(loss, loss_ref, **TOL, msg=f"{label}: loss at step {step}")
        _check_params(model, ref, label)
        _check_opt_state(opt, model, opt_ref, ref, label)


def test_fused_and_out_optimizers_dp_tp(dist_runner):
    dist_runner.run(4, _more_optimizers, (2, 2))


def _out_kwarg():
    """op(..., out=DTensor) for ops without a dedicated rule: computed, then copied into ``out``."""
    import pytest
    mesh = hp.init_device_mesh("cpu", (4,))
    a, b = torch.randn(6, 5), torch.randn(6, 5)
    da, db = hp.distribute_tensor(a, mesh, [Shard(0)]), hp.distribute_tensor(b, mesh, [Shard(1)])
    out = hp.distribute_tensor(torch.zeros(6, 5), mesh, [Shard(0)])
    local = out.to_local()
    r = torch.maximum(da, db, out=out)
    assert r is out and out.to_local() is local and tuple(out.placements) == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), torch.maximum(a, b), rtol=0, atol=0)
    torch.add(da, 1.5, out=da)  # out aliasing an input
    torch.testing.assert_close(da.full_tensor(), a + 1.5, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"out= DTensor has global shape \(6, 4\) but the result has \(6, 5\)"):
        torch.mul(da, db, out=hp.distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]))
    w = hp.distribute_tensor(torch.randn(6, 5), mesh, [Shard(0)]).requires_grad_()
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        torch.mul(w, 2.0, out=out)
    return True


def test_out_kwarg_4(dist_runner):
    assert dist_runner.run(4, _out_kwarg) == [True] * 4


def _norm_specs(mesh):
    """(shape, placements): uneven shards, empty local shards, Partial, sharded on either mesh dim."""
    if mesh.ndim == 1:
        return [((5, 3), [Shard(0)]), ((5, 3), [Shard(1)]), ((7,), [Shard(0)]), ((3,), [Shard(0)]),
                ((3, 4), [Partial()]), ((2, 2), [Replicate()])]
    return [((5, 3), [Shard(0), Shard(1)]), ((5, 3), [Shard(1), Shard(0)]), ((7,), [Shard(0), Shard(0)]),
            ((3,), [Replicate(), Shard(0)]), ((3, 4), [Partial(), Shard(1)]), ((2, 2), [Replicate(), Partial()])]


def _norms_mixed_layouts():
    """get_total_norm / clip_grads_with_norm_ (what clip_grad_norm_ runs) and torch._foreach_norm on
    tensors sharded in every way at once: exact global norms, for 1, 2, 3 and inf, foreach or not."""
    for shape in [(4,), (2, 2)]:
        mesh = hp.init_device_mesh("cpu", shape)
        specs = _norm_specs(mesh)
        gen = torch.Generator().manual_seed(7)
        fulls = [torch.randn(s, generator=gen) for s, _ in specs]
        fulls[0][1, 1] = fulls[0][2, 0] = 0.0  # zeros count for ord=0
        for norm_type in (0.0, 0.5, 1.0, 2.0, 3.0, math.inf, -math.inf, -1.0):
            label = f"{shape} norm_type={norm_type}"
            ref_each = list(torch._foreach_norm(fulls, norm_type))
            dts = [_make(f, mesh, pl, False) for f, (_, pl) in zip(fulls, specs)]
            # a plain (replicated) tensor in the list, and the dtype argument
            each = torch._foreach_norm(dts + [fulls[0]], norm_type, dtype=torch.float64)
            for i, (e, r) in enumerate(zip(each, ref_each + [ref_each[0]])):
                e = e.full_tensor() if isinstance(e, hp.DTensor) else e
                assert e.dtype == torch.float64, f"{label}: _foreach_norm dtype of entry {i}: {e.dtype}"
                torch.testing.assert_close(e, r.double(), rtol=1e-6, atol=1e-6, msg=f"{label}: _foreach_norm[{i}]")
            if norm_type not in (1.0, 2.0, 3.0, math.inf):
                continue
            for foreach in (True, False):
                ref = [f.clone() for f in fulls]
                ref_total = nn.utils.get_total_norm(ref, norm_type, foreach=foreach)
                nn.utils.clip_grads_with_norm_(ref, 0.5 * ref_total, ref_total, foreach=foreach)
                dts = [_make(f, mesh, pl, False) for f, (_, pl) in zip(fulls, specs)]
                total = nn.utils.get_total_norm(dts, norm_type, foreach=foreach)
                assert isinstance(total, hp.DTensor) and all(p.is_replicate() for p in total.placements), label
                torch.testing.assert_close(total.full_tensor(), ref_total, **TOL, msg=f"{label} foreach={foreach}")
                nn.utils.clip_grads_with_norm_(dts, 0.5 * ref_total, total, foreach=foreach)
                for i, (d, r) in enumerate(zip(dts, ref)):
                    torch.testing.assert_close(d.full_tensor(), r, **TOL, msg=f"{label} foreach={foreach}: clipped [{i}]")


def test_clip_norms_mixed_layouts(dist_runner):
    dist_runner.run(4, _norms_mixed_layouts)


class Attn(nn.Module):
    """A small attention block computed entirely on DTensors (heads sharded by the parameters)."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.wqkv = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(3)])
        self.wo = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm(x)
        q, k, v = [w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in self.wqkv]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(b, s, d)
        return x + F.dropout(self.wo(o), p=0.0)


def _train_attention(mesh_shapes):
    for mesh_shape in mesh_shapes:
        mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[-len(mesh_shape):])
        tp = mesh.ndim - 1
        label = f"attention {mesh_shape}"
        torch.manual_seed(0)
        ref = Attn()
        model = copy.deepcopy(ref)

        def partition(name, mod, m):
            if name.startswith("wqkv."):
                mod.weight = nn.Parameter(hp.distribute_tensor(mod.weight.data, m, _pl(m, tp, 0)))
            elif name == "wo":
                mod.weight = nn.Parameter(hp.distribute_tensor(mod.weight.data, m, _pl(m, tp, 1)))
        hp.distribute_module(model, mesh, partition)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        clip = (0.1, None, 2.0)
        loss_fn = lambda out, _: out.pow(2).mean()
        clipped = False
        for step in range(STEPS):
            x = torch.randn(2, 6, 16)
            loss_ref, norm_ref = _ref_step(ref, opt_ref, x, None, clip, True, loss_fn)
            loss, norm = _dt_step(model, opt, x, None, clip, True, loss_fn, mesh, _batch_pl(mesh))
            torch.testing.assert_close(loss, loss_ref, **TOL, msg=f"{label}: loss at step {step}")
            torch.testing.assert_close(norm, norm_ref, **TOL, msg=f"{label}: clip norm at step {step}")
            clipped |= bool(norm_ref > clip[0])
        assert clipped, f"{label}: max_norm never clipped"
        _check_params(model, ref, label)
        _check_opt_state(opt, model, opt_ref, ref, label)
        assert all(isinstance(v, hp.DTensor) for v in model.state_dict().values()), label


def test_attention_block_training(dist_runner):
    dist_runner.run(2, _train_attention, [(2,)])


def test_attention_block_training_4_ranks(dist_runner):
    dist_runner.run(4, _train_attention, [(4,), (2, 2)])
