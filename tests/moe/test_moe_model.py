"""Single-process checks of the example MoE feed-forward (examples/llama/moe.py), in float64.

Routing (softmax/sigmoid, expert bias steering the choice only, DeepSeek-V3 group-limited
routing), token reordering, the grouped experts against a per-token computation, the whole MoE
layer (values and gradients, with and without the shared expert and the auxiliary loss) against
a token-by-token reference, the aux-loss-free bias update, the configs and bad input.
"""
import math
import pytest
import torch
import torch.nn.functional as F

from examples.llama.configs import get_config
from examples.llama.model import build_model
from examples.llama.moe import (MoE, MoEArgs, GroupedExperts, expert_load, format_load, group_limited,
                                reorder_tokens, run_experts_loop, sequence_aux_loss, update_expert_bias)
from examples.llama.reference import train_reference

DIM = 16


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread (as the distributed workers; the machine's cores are shared)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _moe(seed=0, **kw):
    args = MoEArgs(**{**dict(num_experts=8, top_k=2, hidden_dim=12, n_shared_experts=1), **kw})
    m = MoE(DIM, args).double()
    g = _gen(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return m


def _swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def _per_token_reference(m: MoE, x: torch.Tensor, bias=None):
    """out[t] = shared(x_t) + sum_k weight_k(t) * expert_{id_k(t)}(x_t), token by token, routing by hand."""
    a = m.args
    flat = x.reshape(-1, DIM)
    logits = flat @ m.router.gate.weight.T
    scores = torch.sigmoid(logits) if a.score_func == "sigmoid" else torch.softmax(logits, -1)
    outs = []
    for t in range(flat.shape[0]):
        choice = scores[t].detach() + (bias if bias is not None else 0)
        allowed = list(range(a.num_experts))
        if a.n_groups > 1:
            per = a.num_experts // a.n_groups
            gs = [sorted(choice[g * per:(g + 1) * per].tolist(), reverse=True)[:2] for g in range(a.n_groups)]
            best = sorted(range(a.n_groups), key=lambda g: -sum(gs[g]))[:a.topk_groups]
            allowed = [e for e in allowed if e // per in best]
        ids = sorted(allowed, key=lambda e: -float(choice[e]))[:a.top_k]
        w = scores[t, ids]
        if a.route_norm:
            w = w / w.sum()
        w = w * a.route_scale
        o = m.shared_experts(flat[t]) if m.shared_experts is not None else torch.zeros_like(flat[t])
        for k, e in enumerate(ids):
            o = o + w[k] * _swiglu(flat[t], m.experts.w1[e], m.experts.w2[e], m.experts.w3[e])
        outs.append(o)
    return torch.stack(outs).view_as(x)


CASES = {
    "softmax_shared": dict(score_func="softmax"),
    "softmax_no_shared": dict(score_func="softmax", n_shared_experts=0, top_k=3),
    "sigmoid_norm_scale": dict(score_func="sigmoid", route_norm=True, route_scale=2.5),
    "sigmoid_groups": dict(score_func="sigmoid", route_norm=True, n_groups=4, topk_groups=2),
    "softmax_groups_top1": dict(score_func="softmax", n_groups=2, topk_groups=1, top_k=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_layer_matches_per_token_reference(case):
    """Values and gradients (input, router gate, experts, shared expert) of the reordered/grouped layer."""
    m = _moe(**CASES[case])
    with torch.no_grad():
        m.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8, dtype=torch.float64))  # steers the choice only
    x = torch.randn(3, 5, DIM, generator=_gen(1), dtype=torch.float64, requires_grad=True)
    out = m(x)
    x2 = x.detach().clone().requires_grad_(True)
    want = _per_token_reference(m, x2, m.expert_bias)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g = torch.randn(out.shape, generator=_gen(2), dtype=torch.float64)
    got_grads = torch.autograd.grad(out, [x] + list(m.parameters()), g)
    want_grads = torch.autograd.grad(want, [x2] + list(m.parameters()), g, allow_unused=True)
    for (name, _), a, b in zip([("x", None)] + list(m.named_parameters()), got_grads, want_grads):
        torch.testing.assert_close(a, b if b is not None else torch.zeros_like(a), rtol=1e-12, atol=1e-12,
                                   msg=name)
    # every token was routed top_k times (dropless) and counted once per choice
    assert int(m.tokens_per_expert.sum()) == 15 * m.args.top_k


def test_bias_changes_the_choice_not_the_weights():
    m = _moe(score_func="softmax")
    x = torch.randn(20, DIM, generator=_gen(3), dtype=torch.float64)
    w0, ids0, scores = m.router(x, None)
    bias = torch.zeros(8, dtype=torch.float64)
    bias[ids0[:, 0]] = -10.0  # push every token's first choice out
    w1, ids1, _ = m.router(x, bias)
    assert not (ids1 == ids0[:, :1]).any()
    torch.testing.assert_close(w1, scores.gather(1, ids1))  # weights: unbiased scores of the new choice
    torch.testing.assert_close(w0, scores.topk(2, dim=-1).values)


def test_group_limited_routing_by_hand():
    # 8 experts, 4 groups of 2; group scores (sum of both): g0 1.0, g1 1.6, g2 0.9, g3 1.5
    choice = torch.tensor([[0.1, 0.9, 0.8, 0.8, 0.45, 0.45, 0.95, 0.55]], dtype=torch.float64)
    masked = group_limited(choice, 4, 2)
    assert torch.isinf(masked[0, [0, 1, 4, 5]]).all() and not torch.isinf(masked[0, [2, 3, 6, 7]]).any()
    # plain top-2 would take experts 6 and 1; limited to groups 1 and 3 it takes 6 and 2 (stable on the tie 2/3)
    assert masked.topk(2).indices.tolist() == [[6, 2]]
    m = _moe(score_func="sigmoid", n_groups=4, topk_groups=2)
    x = torch.randn(50, DIM, generator=_gen(4), dtype=torch.float64)
    _, ids, _ = m.router(x, None)
    assert all(len(set((r // 2).tolist())) <= 2 for r in ids)
    assert len(set((ids // 2).reshape(-1).tolist())) > 2  # different tokens pick different groups


def test_reorder_groups_rows_by_expert_stably():
    ids = torch.tensor([[3, 0], [0, 3], [2, 0], [3, 1]])
    order, token_idx, counts = reorder_tokens(ids, 5)
    assert counts.tolist() == [3, 1, 1, 3, 0]  # expert 4 gets no tokens
    assert ids.reshape(-1)[order].tolist() == [0, 0, 0, 1, 2, 3, 3, 3]
    assert token_idx.tolist() == [0, 1, 2, 3, 2, 0, 1, 3]  # ties keep token order
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 3\).*max 3"):
        reorder_tokens(ids, 3)


def test_grouped_experts_with_empty_experts():
    e, hidden = 4, 6
    ge = GroupedExperts(DIM, hidden, e).double()
    g = _gen(5)
    with torch.no_grad():
        for p in ge.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    counts = torch.tensor([2, 0, 3, 0])
    x = torch.randn(5, DIM, generator=g, dtype=torch.float64)
    want = torch.cat([_swiglu(x[:2], ge.w1[0], ge.w2[0], ge.w3[0]), _swiglu(x[2:], ge.w1[2], ge.w2[2], ge.w3[2])])
    for use_grouped_mm in (True, False):  # hyper_parallel.moe.grouped_mm, and the example's loop
        ge.use_grouped_mm = use_grouped_mm
        torch.testing.assert_close(ge(x, counts), want, rtol=1e-12, atol=1e-12)
        assert ge(x[:0], torch.zeros(4, dtype=torch.long)).shape == (0, DIM)
        with pytest.raises(ValueError, match="sums to 4"):
            ge(x, torch.tensor([2, 0, 2, 0]))
        with pytest.raises(ValueError, match="3 entries for 4"):
            ge(x, torch.tensor([2, 0, 3]))
    torch.testing.assert_close(run_experts_loop(ge.w1, ge.w2, ge.w3, x, counts), want, rtol=1e-12, atol=1e-12)


def test_aux_loss_gradient():
    """The sequence-wise balance loss reaches the router gate's gradient; the forward value is unchanged."""
    coeff = 0.05
    m, m0 = _moe(aux_loss_coeff=coeff), _moe(aux_loss_coeff=0.0)
    x = torch.randn(2, 6, DIM, generator=_gen(6), dtype=torch.float64)
    out, out0 = m(x), m0(x)
    torch.testing.assert_close(out, out0, rtol=0, atol=0)
    out.sum().backward()
    out0.sum().backward()
    logits = x.reshape(-1, DIM) @ m0.router.gate.weight.T
    scores = torch.softmax(logits, -1)
    ids = scores.topk(2, -1).indices
    aux = coeff * sequence_aux_loss(scores, ids, 2, 8, 2)
    torch.testing.assert_close(m.last_aux_loss, aux.detach())
    (g_aux,) = torch.autograd.grad(aux, m0.router.gate.weight)
    torch.testing.assert_close(m.router.gate.weight.grad, m0.router.gate.weight.grad + g_aux, rtol=1e-12, atol=1e-14)
    assert g_aux.abs().max() > 1e-6
    # perfectly balanced choices with uniform scores: sum_e f_e P_e = 1
    s = torch.full((1, 8, 4), 0.25, dtype=torch.float64).view(8, 4)
    ids = torch.tensor([[0, 1], [2, 3]] * 4)
    assert math.isclose(float(sequence_aux_loss(s, ids, 1, 4, 2)), 1.0)


def test_expert_bias_update_and_metrics():
    model = build_model(get_config("moe-tiny").model)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(layers) == 2
    counts = torch.tensor([10., 0., 4., 6., 6., 4., 2., 0.])
    layers[0].tokens_per_expert.copy_(counts)
    layers[1].tokens_per_expert.copy_(torch.full((8,), 4.))
    load = update_expert_bias(model)
    coeff = layers[0].args.load_balance_coeff
    delta = coeff * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(layers[0].expert_bias, delta - delta.mean())
    assert torch.equal(layers[1].expert_bias, torch.zeros(8))  # balanced: no change
    assert all(int(m.tokens_per_expert.sum()) == 0 for m in layers)
    assert abs(float(layers[0].expert_bias.sum())) < 1e-9
    assert torch.equal(load["layers.1.moe"], counts)
    toks, imb = expert_load(load)["layers.1.moe"]
    assert toks == [10, 0, 4, 6, 6, 4, 2, 0] and imb == 10 / 4
    assert "L1 max/mean 2.50" in format_load(load)


def test_moe_configs_and_names():
    for name in ("moe-tiny", "moe-demo"):
        cfg = get_config(name)
        model = build_model(cfg.model)
        assert hasattr(model.layers["0"], "feed_forward") and not hasattr(model.layers["0"], "moe")
        for i in range(1, cfg.model.n_layers):
            assert hasattr(model.layers[str(i)], "moe") and not hasattr(model.layers[str(i)], "feed_forward")
        sd = model.state_dict()
        e, k = cfg.model.moe.num_experts, cfg.model.moe.top_k
        assert 8 <= e <= 16 and k == 2 and cfg.model.moe.n_shared_experts == 1
        h = cfg.model.moe.hidden_dim
        assert sd["layers.1.moe.experts.w1"].shape == (e, h, cfg.model.dim)
        assert sd["layers.1.moe.experts.w3"].shape == (e, h, cfg.model.dim)
        assert sd["layers.1.moe.experts.w2"].shape == (e, cfg.model.dim, h)
        assert "layers.1.moe.expert_bias" in sd and "layers.1.moe.tokens_per_expert" not in sd
        assert sd["layers.1.moe.router.gate.weight"].shape == (e, cfg.model.dim)
    # get_config copies: editing one MoEArgs does not touch the registry
    cfg = get_config("moe-tiny")
    cfg.model.moe.top_k = 1
    assert get_config("moe-tiny").model.moe.top_k == 2


def test_dense_configs_unchanged():
    """Dense models have no MoE parts and the same init as before the MoE option (a fixed checksum)."""
    for name in ("tiny", "demo"):
        model = build_model(get_config(name).model)
        assert not any(isinstance(m, MoE) for m in model.modules())
        assert not any("moe" in k for k in model.state_dict())
    # sums of |w| over the whole initial state dict, computed with the code before the MoE option
    for name, want in (("tiny", 3514.2472182685397), ("demo", 13745.881365399866)):
        sd = build_model(get_config(name).model).state_dict()
        assert sum(float(v.double().abs().sum()) for v in sd.values()) == want, name


def test_moe_training_reduces_loss_and_is_deterministic():
    cfg = get_config("moe-tiny")
    kw = dict(seed=0, global_batch=cfg.global_batch, seq_len=cfg.seq_len, optim=cfg.optim)
    losses, sd = train_reference(cfg.model, 4, **kw)
    losses2, sd2 = train_reference(cfg.model, 4, **kw)
    assert losses == losses2 and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert losses[-1] < losses[0] - 1.0, losses
    assert sd["layers.1.moe.expert_bias"].abs().sum() > 0  # the balancing step ran


@pytest.mark.parametrize("kw, match", [
    (dict(top_k=9), r"top_k=9 must be in \[1, num_experts=8\]"),
    (dict(score_func="relu"), "score_func"),
    (dict(n_groups=3), "n_groups=3 must be >= 1 and divide num_experts=8"),
    (dict(n_groups=4, topk_groups=5), r"topk_groups=5 must be in \[1, n_groups=4\]"),
    (dict(n_groups=8, topk_groups=1, top_k=2), "hold fewer than top_k=2"),
    (dict(load_balance_coeff=0.0), "load_balance_coeff"),
])
def test_bad_moe_args(kw, match):
    with pytest.raises(ValueError, match=match):
        MoEArgs(**{**dict(num_experts=8, top_k=2), **kw})


def test_no_bias_without_balancing():
    m = _moe(load_balance_coeff=None)
    assert m.expert_bias is None and "expert_bias" not in m.state_dict()
    m(torch.randn(1, 4, DIM, dtype=torch.float64))
    model = torch.nn.Module()
    model.moe = m
    load = update_expert_bias(model)
    assert int(load["moe"].sum()) == 8


@pytest.mark.parametrize("kw", [dict(score_func="softmax"),
                                dict(score_func="sigmoid", route_norm=True, route_scale=2.0),
                                dict(score_func="sigmoid", route_norm=True, n_groups=4, topk_groups=2)])
def test_router_agrees_with_library_route_topk(kw):
    """The example's router (kept: it keeps float64 scores in float64) equals ``hyper_parallel.moe.route_topk``
    in float32."""
    from hyper_parallel.moe import route_topk
    m = _moe(**kw).float()
    bias = torch.linspace(-0.05, 0.05, 8)
    x = torch.randn(40, DIM, generator=_gen(7))
    w, ids, _ = m.router(x, bias)
    a = m.args
    w2, ids2 = route_topk(m.router.gate(x), a.top_k, score_func=a.score_func, expert_bias=bias,
                          num_groups=a.n_groups if a.n_groups > 1 else None,
                          top_groups=a.topk_groups if a.n_groups > 1 else None, normalize=a.route_norm,
                          scale=a.route_scale)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2)
