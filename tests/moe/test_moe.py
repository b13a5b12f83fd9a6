"""Expert parallelism (hyper_parallel.moe) against one process.

A small MoE layer defined here (router, top-k, optional shared expert, GroupedExperts-contract
experts) runs at EP 2 and EP 4: every rank routes its own tokens; the reference is one process
running the whole batch (all ranks' tokens concatenated) with a plain per-token loop over the
chosen experts. Forward values and every gradient are compared in float64 at 1e-10.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import moe, parallelize_module

TOL = dict(rtol=1e-10, atol=1e-10)
DIM, HID = 8, 12


# ----------------------------------------------------------------------------- the test MoE layer
def _local(w):
    return w.to_local() if isinstance(w, hp.DTensor) else w


class Experts(nn.Module):
    """The GroupedExperts contract: w1, w3 [E, hidden, dim], w2 [E, dim, hidden]; rows grouped by expert."""

    def __init__(self, E, dim=DIM, hidden=HID, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(E, hidden, dim, generator=g, dtype=torch.float64) / dim ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, dim, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5)
        self.w3 = nn.Parameter(torch.randn(E, hidden, dim, generator=g, dtype=torch.float64) / dim ** 0.5)

    def forward(self, x, num_tokens_per_expert):
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        offs = torch.cumsum(num_tokens_per_expert, 0).to(torch.int32)
        h = F.silu(moe.grouped_mm(x, w1.transpose(-2, -1), offs)) * moe.grouped_mm(x, w3.transpose(-2, -1), offs)
        return moe.grouped_mm(h, w2.transpose(-2, -1), offs)


def _expert_ref(x, w1, w2, w3, e):
    return (F.silu(x @ w1[e].t()) * (x @ w3[e].t())) @ w2[e].t()


class MoE(nn.Module):
    def __init__(self, E, top_k, score="softmax", shared=False, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed + 1)
        self.E, self.top_k, self.score = E, top_k, score
        self.router = nn.Parameter(torch.randn(E, DIM, generator=g, dtype=torch.float64))
        self.experts = Experts(E, seed=seed)
        self.shared = None
        if shared:
            self.shared = nn.Linear(DIM, DIM, dtype=torch.float64)
            with torch.no_grad():
                self.shared.weight.copy_(torch.randn(DIM, DIM, generator=g, dtype=torch.float64) / DIM ** 0.5)
                self.shared.bias.copy_(torch.randn(DIM, generator=g, dtype=torch.float64))

    def route(self, x):
        logits = x @ self.router.t()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        w, ids = torch.topk(scores, self.top_k, dim=-1)
        if self.score == "sigmoid":
            w = w / w.sum(-1, keepdim=True)
        return w, ids

    def forward(self, x):
        """Style path: permute by expert, call the (ExpertParallel-wrapped) experts, un-permute."""
        w, ids = self.route(x)
        T, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.E)
        y = self.experts(x[order // k], counts)
        full = torch.zeros_like(y).index_copy(0, order, y).view(T, k, -1)
        out = (full * w.unsqueeze(-1)).sum(1)
        return out + self.shared(x) if self.shared is not None else out

    def forward_dispatch(self, x, ep_mesh, capacity_factor=None):
        """Library path: dispatch/combine from the router outputs, experts run on local weights."""
        w, ids = self.route(x)
        routed, counts, handle = moe.dispatch(x, ids, ep_mesh, num_experts=self.E, capacity_factor=capacity_factor)
        y = Experts.forward(self.experts, routed, counts)
        out = moe.combine(y, handle, w)
        out = out + self.shared(x) if self.shared is not None else out
        return out, handle


def _reference_forward(model, x, capacity_factor=None):
    """One process, a plain loop: out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]); with a capacity factor
    expert e keeps its first ceil(f * T * k / E) assignments in token order."""
    w, ids = model.route(x)
    T, k = ids.shape
    keep = torch.ones(T, k, dtype=torch.bool)
    if capacity_factor is not None:
        import math
        cap = math.ceil(capacity_factor * T * k / model.E)
        seen = [0] * model.E
        for t in range(T):
            for j in range(k):
                e = int(ids[t, j])
                keep[t, j] = seen[e] < cap
                seen[e] += 1
    ex = model.experts
    rows = []
    for t in range(T):
        acc = torch.zeros(DIM, dtype=x.dtype)
        for j in range(k):
            if keep[t, j]:
                acc = acc + w[t, j] * _expert_ref(x[t:t + 1], ex.w1, ex.w2, ex.w3, int(ids[t, j]))[0]
        rows.append(acc)
    out = torch.stack(rows)
    if model.shared is not None:
        out = out + model.shared(x)
    return out, keep


def _tokens(world, rank_sizes, seed=7):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, DIM, generator=g, dtype=torch.float64) for n in rank_sizes]
    gs = [torch.randn(n, DIM, generator=g, dtype=torch.float64) for n in rank_sizes]
    return xs, gs


def _mesh(world, ep):
    if ep == world:
        return hp.init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    return hp.init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))


def _rank_sizes(world):
    # uneven token counts per rank (and one rank with very few)
    return [5, 9, 1, 7][:world] if world <= 4 else [5] * world


def _check_layer(ep, E, top_k, score, shared, path, capacity_factor):
    """Forward + backward on every rank; compare with one process on the concatenated batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = _rank_sizes(world)
    xs, gs = _tokens(world, sizes)
    ref = MoE(E, top_k, score, shared)
    xr = torch.cat(xs).requires_grad_(True)
    out_ref, keep_ref = _reference_forward(ref, xr, capacity_factor)
    (out_ref * torch.cat(gs)).sum().backward()

    mesh = _mesh(world, ep)
    ep_mesh = mesh["ep"]
    model = MoE(E, top_k, score, shared)
    x = xs[rank].clone().requires_grad_(True)
    lo = sum(sizes[:rank])
    if path == "style":
        parallelize_module(model, ep_mesh, {"experts": moe.ExpertParallel()})
        out = model(x)
    else:
        # the dispatch path: this rank keeps only its experts' weights
        el = E // ep
        r = ep_mesh.get_local_rank()
        for n in ("w1", "w2", "w3"):
            p = getattr(model.experts, n)
            setattr(model.experts, n, nn.Parameter(p.detach()[r * el:(r + 1) * el].clone()))
        out, handle = model.forward_dispatch(x, ep_mesh, capacity_factor)
        torch.testing.assert_close(handle.kept_mask, keep_ref[lo:lo + sizes[rank]])
        dropped = int((~keep_ref).sum())
        assert handle.dropped == dropped, (handle.dropped, dropped)
        assert (dropped > 0) == (capacity_factor is not None)   # the capacity cases do drop tokens
    torch.testing.assert_close(out, out_ref[lo:lo + sizes[rank]].detach(), **TOL)
    (out * gs[rank]).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad[lo:lo + sizes[rank]], **TOL)
    # replicated parameters: this rank's gradient is its tokens' share; the sum over ranks is the whole
    for name, p in (("router", model.router),) + ((("shared.weight", model.shared.weight),
                                                   ("shared.bias", model.shared.bias)) if shared else ()):
        g = p.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g, dict(ref.named_parameters())[name].grad, **TOL)
    # expert weights: each rank holds the whole gradient of its experts (tokens of every rank reach them)
    el, r = E // ep, ep_mesh.get_local_rank()
    for n in ("w1", "w2", "w3"):
        p = getattr(model.experts, n)
        if isinstance(p, hp.DTensor):
            assert tuple(p.placements) == (hp.Shard(0),)
        got = _local(p.grad)
        want = getattr(ref.experts, n).grad[r * el:(r + 1) * el]
        if ep < world:  # the same experts on every dp replica: the whole gradient is the sum over dp
            got = got.clone()
            dist.all_reduce(got, group=mesh["dp"].get_group())
        torch.testing.assert_close(got, want, **TOL)
    return True


@pytest.mark.parametrize("world,ep,E,top_k,score,shared", [
    (2, 2, 4, 1, "softmax", False),
    (2, 2, 4, 2, "sigmoid", True),
    (4, 4, 8, 2, "softmax", True),
    (4, 2, 4, 3, "sigmoid", False),      # ("dp", "ep") mesh, EP over the inner dim
])
def test_expert_parallel_style(dist_runner, world, ep, E, top_k, score, shared):
    assert all(dist_runner.run(world, _check_layer, ep, E, top_k, score, shared, "style", None))


@pytest.mark.parametrize("world,ep,E,top_k,score,shared,cf", [
    (2, 2, 4, 2, "softmax", False, None),
    (2, 2, 4, 2, "sigmoid", True, 1.0),
    (4, 4, 8, 2, "sigmoid", False, 0.75),
    (4, 4, 4, 3, "softmax", True, None),
])
def test_dispatch_combine_layer(dist_runner, world, ep, E, top_k, score, shared, cf):
    assert all(dist_runner.run(world, _check_layer, ep, E, top_k, score, shared, "dispatch", cf))


def _check_etp(E, top_k, score):
    """ExpertTensorParallel on a ("ep", "tp") = (2, 2) mesh: tokens data-parallel over ep (the same on both
    tp ranks), each expert column/row-parallel over tp; the experts' output is a partial sum over tp."""
    rank = dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    e_rank, t_rank = mesh.get_local_rank("ep"), mesh.get_local_rank("tp")
    sizes = [6, 3]
    xs, gs = _tokens(2, sizes)
    ref = MoE(E, top_k, score)
    xr = torch.cat(xs).requires_grad_(True)
    out_ref, _ = _reference_forward(ref, xr)
    (out_ref * torch.cat(gs)).sum().backward()

    model = MoE(E, top_k, score)
    parallelize_module(model, mesh, {"experts": moe.ExpertTensorParallel()})
    assert tuple(model.experts.w1.placements) == (hp.Shard(0), hp.Shard(1))
    assert tuple(model.experts.w2.placements) == (hp.Shard(0), hp.Shard(2))
    x = xs[e_rank].clone().requires_grad_(True)
    out = model(x)                                       # partial over tp
    (out * gs[e_rank]).sum().backward()
    tp = mesh["tp"].get_group()
    lo = sum(sizes[:e_rank])
    full = out.detach().clone()
    dist.all_reduce(full, group=tp)
    torch.testing.assert_close(full, out_ref[lo:lo + sizes[e_rank]].detach(), **TOL)
    gx = x.grad.clone()
    dist.all_reduce(gx, group=tp)
    torch.testing.assert_close(gx, xr.grad[lo:lo + sizes[e_rank]], **TOL)
    gr = model.router.grad.clone()
    dist.all_reduce(gr)
    torch.testing.assert_close(gr, ref.router.grad, **TOL)
    el = E // 2
    for n, tdim in (("w1", 1), ("w3", 1), ("w2", 2)):
        want = getattr(ref.experts, n).grad[e_rank * el:(e_rank + 1) * el]
        want = want.chunk(2, dim=tdim)[t_rank]
        torch.testing.assert_close(getattr(model.experts, n).grad.to_local(), want, **TOL)
    return rank


def test_expert_tensor_parallel(dist_runner):
    assert dist_runner.run(4, _check_etp, 4, 2, "softmax") == [0, 1, 2, 3]



def _check_ep_fsdp():
    """EP borrowing ranks from FSDP (torchtitan's layout) on a (dp 2, ep 2) mesh: ExpertParallel on mesh["ep"],
    the experts fully_shard-ed over mesh["dp"] (the "efsdp" dim) with the gradient divided by all 4
    data-parallel ranks, the dense parameters fully_shard-ed over the flattened (dp, ep) mesh. Gradients
    are the average over the 4 ranks' losses (FSDP's convention): one process's gradient / 4."""
    rank, world = dist.get_rank(), dist.get_world_size()
    E, top_k = 4, 2
    sizes = _rank_sizes(world)
    xs, gs = _tokens(world, sizes)
    ref = MoE(E, top_k, "sigmoid", shared=True)
    xr = torch.cat(xs).requires_grad_(True)
    out_ref, _ = _reference_forward(ref, xr)
    (out_ref * torch.cat(gs)).sum().backward()

    mesh = _mesh(world, 2)
    model = MoE(E, top_k, "sigmoid", shared=True)
    parallelize_module(model, mesh["ep"], {"experts": moe.ExpertParallel()})
    hp.fully_shard(model.experts, mesh=mesh["dp"])
    model.experts.set_gradient_divide_factor(world)
    hp.fully_shard(model, mesh=mesh._flatten("dp_ep"))
    x = xs[rank].clone().requires_grad_(True)
    out = model(x)
    lo = sum(sizes[:rank])
    torch.testing.assert_close(out, out_ref[lo:lo + sizes[rank]].detach(), **TOL)
    (out * gs[rank]).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad[lo:lo + sizes[rank]], **TOL)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), want[name].grad / world, **TOL)
    # dp shards inside the ep shard: torch's (_StridedShard(0, split_factor=ep), Shard(0)) on (dp, ep)
    from hyper_parallel.placement_types import _StridedShard
    assert tuple(model.experts.w1.placements) == (_StridedShard(0, split_factor=mesh["ep"].size()), hp.Shard(0))
    return True


def test_expert_parallel_with_fully_shard(dist_runner):
    assert all(dist_runner.run(4, _check_ep_fsdp))
