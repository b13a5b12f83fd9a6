"""hyper_parallel.moe dispatch / combine: round trips, gradcheck, collective counts and bytes, bad input.

Real gloo jobs on 2 and 4 ranks; float64.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hyper_parallel as hp
from hyper_parallel import moe, parallelize_module

TOL = dict(rtol=1e-12, atol=1e-12)
DIM = 6


def _ep_mesh():
    return hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))


def _routing(case, rank, world, E, k):
    """(T, ids) of one rank for a named routing case."""
    g = torch.Generator().manual_seed(11 + rank)
    T = {"top1": 7, "topk": 5, "skewed": 6, "empty_rank": 0 if rank == 1 else 4}[case] + (rank if case != "empty_rank" else 0)
    if case == "skewed":  # every token to experts 0 and 1 (rank 0's): other experts and ranks get nothing
        ids = torch.stack([torch.zeros(T, dtype=torch.long), torch.ones(T, dtype=torch.long)], 1)[:, :k]
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    return T, ids


def _round_trip(case, E, k):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _ep_mesh()
    T, ids = _routing(case, rank, world, E, k)
    x = torch.randn(T, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    routed, counts, h = moe.dispatch(x, ids, mesh, num_experts=E)
    # what this rank must receive: rows of every rank for its experts, expert-major, then rank, then token
    all_x = [torch.empty(0)] * world
    all_ids = [None] * world
    dist.all_gather_object(all_x, x)
    dist.all_gather_object(all_ids, ids)
    el = E // world
    want, want_counts = [], []
    for e in range(rank * el, (rank + 1) * el):
        n = 0
        for r in range(world):
            for t in range(all_x[r].shape[0]):
                if (all_ids[r][t] == e).any():
                    want.append(all_x[r][t])
                    n += 1
        want_counts.append(n)
    want = torch.stack(want) if want else x.new_zeros(0, DIM)
    torch.testing.assert_close(routed, want, **TOL)
    assert counts.tolist() == want_counts and h.local_expert_tokens == want_counts
    # identity experts: combine gives the weighted sum of k copies
    w = torch.rand(T, k, dtype=torch.float64, generator=torch.Generator().manual_seed(5 + rank))
    torch.testing.assert_close(moe.combine(routed, h, w), x * w.sum(1, keepdim=True), **TOL)
    torch.testing.assert_close(moe.combine(routed, h), x * k, **TOL)
    assert h.dropped == 0 and bool(h.kept_mask.all())
    return sum(want_counts)


@pytest.mark.parametrize("world,case,E,k", [
    (2, "top1", 4, 1), (2, "topk", 4, 3), (2, "skewed", 4, 2), (2, "empty_rank", 6, 2),
    (4, "topk", 8, 2), (4, "skewed", 4, 2),
])
def test_round_trip(dist_runner, world, case, E, k):
    received = dist_runner.run(world, _round_trip, case, E, k)
    if case == "skewed":  # all to experts 0 and 1: the ranks holding other experts receive nothing
        holders = 1 if E // world >= 2 else 2
        assert received[holders:] == [0] * (world - holders) and all(received[:holders])


def _gradcheck():
    rank = dist.get_rank()
    mesh = _ep_mesh()
    E, k, T = 4, 2, 3
    ids = torch.tensor([[0, 3], [2, 1], [3, 2]]) if rank == 0 else torch.tensor([[1, 0], [0, 2], [3, 0]])
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, 2, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(T, k, dtype=torch.float64, generator=g, requires_grad=True)

    def fn(x, w):
        routed, counts, h = moe.dispatch(x, ids, mesh, num_experts=E)
        scale = torch.repeat_interleave(torch.arange(1, counts.numel() + 1, dtype=x.dtype), counts)
        y = routed * routed * scale[:, None] + routed          # a nonlinear, expert-dependent "expert"
        return moe.combine(y, h, w)

    assert torch.autograd.gradcheck(fn, (x, w), eps=1e-6, atol=1e-8)

    # the style's exchange (rows already grouped by expert)
    from hyper_parallel.moe.token_exchange import dispatch_sorted
    counts = torch.tensor([1, 0, 2, 1]) if rank == 0 else torch.tensor([0, 3, 0, 1])
    rows = torch.randn(4, 2, dtype=torch.float64, generator=g, requires_grad=True)
    group = mesh.get_comm_group(0)

    def fn2(rows):
        out, c, ex = dispatch_sorted(rows, counts, group, E)
        return ex.combine(out * out * (1 + c.sum()))

    assert torch.autograd.gradcheck(fn2, (rows,), eps=1e-6, atol=1e-8)
    return True


def test_gradcheck(dist_runner):
    assert all(dist_runner.run(2, _gradcheck))


class _Experts(nn.Module):
    def __init__(self, E, dim):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(E, 4, dim, dtype=torch.float64, generator=g))
        self.w2 = nn.Parameter(torch.randn(E, dim, 4, dtype=torch.float64, generator=g))
        self.w3 = nn.Parameter(torch.randn(E, 4, dim, dtype=torch.float64, generator=g))

    def forward(self, x, num_tokens_per_expert):
        offs = torch.cumsum(num_tokens_per_expert, 0)
        w1, w2, w3 = self.w1.to_local(), self.w2.to_local(), self.w3.to_local()
        h = moe.grouped_mm(x, w1.transpose(1, 2), offs) * moe.grouped_mm(x, w3.transpose(1, 2), offs)
        return moe.grouped_mm(h, w2.transpose(1, 2), offs)


def _comm_counts(path):
    """Per MoE layer per step: the count exchange + 2 token all_to_alls forward + 2 backward, with
    bytes = rows * hidden * itemsize (the rows that leave this rank); one host sync (the counts)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _ep_mesh()
    E, k, T = 8, 2, 5 + rank
    _, ids = _routing("topk", rank, world, E, k)
    ids = ids[:T]
    x = torch.randn(T, DIM, dtype=torch.float64, requires_grad=True)
    el = E // world
    local = ((ids // el) == rank).sum().item()                   # assignments to this rank's experts
    isz = 8
    experts = _Experts(E, DIM)
    if path == "style":
        parallelize_module(experts, mesh, moe.ExpertParallel())
    moe.reset_stats()
    with hp.CommDebugMode() as comm:
        if path == "style":
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            y = experts(x[order // k], torch.bincount(flat, minlength=E))
        else:
            routed, counts, h = moe.dispatch(x, ids, mesh, num_experts=E)
            y = moe.combine(routed * 2.0, h)
        y.sum().backward()
    ev = [e for e in comm.events]
    kinds = [e[0] for e in ev]
    assert kinds == ["all_to_all"] * 5, kinds           # count exchange, dispatch, combine, 2 in backward
    count_ev, tok = ev[0], ev[1:]
    received_from_others = None
    # dispatch forward: the T*k rows of this rank minus the ones staying here
    assert tok[0][1] == (T * k - local) * DIM * isz
    received = [None] * world
    dist.all_gather_object(received, [((ids // el) == r).sum().item() for r in range(world)])
    received_from_others = sum(received[s][rank] for s in range(world) if s != rank)
    assert tok[1][1] == received_from_others * DIM * isz     # combine forward sends back what it received
    assert sorted(e[1] for e in tok[2:]) == sorted([tok[0][1], tok[1][1]])   # backward: the inverses
    assert count_ev[1] == (E + 3 * world) * 8 * (world - 1) // world  # independent of the token count
    assert moe.STATS["host_syncs"] == 1 and moe.STATS["count_exchanges"] == 1
    total = torch.tensor([T * k, T * k - local])
    dist.all_reduce(total)
    return total.tolist()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("path", ["style", "dispatch"])
def test_comm_counts_and_bytes(dist_runner, world, path):
    out = dist_runner.run(world, _comm_counts, path)
    assert out[0][0] == sum(2 * (5 + r) for r in range(world))


def _capacity_counts():
    """Capacity mode: the count exchange is one all_gather; still 2 + 2 token all_to_alls."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _ep_mesh()
    ids = torch.zeros(4, 1, dtype=torch.long)           # 4 tokens per rank, all to expert 0
    x = torch.randn(4, DIM, dtype=torch.float64, requires_grad=True)
    with hp.CommDebugMode() as comm:
        routed, counts, h = moe.dispatch(x, ids, mesh, num_experts=world, capacity_factor=1.0)
        moe.combine(routed, h).sum().backward()
    kinds = [e[0] for e in comm.events]
    assert kinds == ["all_gather"] + ["all_to_all"] * 4, kinds
    # capacity = ceil(1.0 * 4 * world * 1 / world) = 4: rank 0's tokens fill expert 0, the rest are dropped
    assert h.capacity == 4 and h.dropped == 4 * (world - 1)
    assert h.dropped_local == (0 if rank == 0 else 4)
    assert h.tokens_per_expert == [4 * world] + [0] * (world - 1)
    assert x.grad.abs().sum().item() == (4 * DIM if rank == 0 else 0)
    return True


def test_capacity_counts(dist_runner):
    assert all(dist_runner.run(2, _capacity_counts))


# ----------------------------------------------------------------------------- bad input
def _raises(exc, match, fn, *a, **kw):
    with pytest.raises(exc, match=match) as info:
        fn(*a, **kw)
    return str(info.value)


def _bad_inputs():
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _ep_mesh()
    x = torch.randn(4, DIM, dtype=torch.float64)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    msgs = []
    # E not divisible by the EP degree (style at apply, dispatch at the call), before any collective
    msgs.append(_raises(ValueError, r"num_experts=3 is not divisible by the EP degree 2",
                        parallelize_module, _Experts(3, DIM), mesh, moe.ExpertParallel()))
    msgs.append(_raises(ValueError, r"num_experts=5 is not divisible by the EP degree 2",
                        moe.dispatch, x, ids, mesh, num_experts=5))
    # top-k greater than the number of experts
    msgs.append(_raises(ValueError, r"top_k=5 is greater than num_experts=4",
                        moe.dispatch, x, torch.zeros(4, 5, dtype=torch.long), mesh, num_experts=4))
    msgs.append(_raises(ValueError, r"capacity_factor must be None \(dropless\) or a finite number > 0, got -1",
                        moe.dispatch, x, ids, mesh, num_experts=4, capacity_factor=-1))
    # expert ids out of range on rank 1 only: every rank raises, naming rank 1 (after the count exchange)
    bad = ids.clone()
    if rank == 1:
        bad[2, 1] = 7
    msgs.append(_raises(ValueError, r"EP rank 1 passed 1 expert ids out of range \(expected ids in \[0, 4\)\)",
                        moe.dispatch, x, bad, mesh, num_experts=4))
    msgs.append(_raises(ValueError, r"EP rank 1 passed 1 expert ids out of range",
                        moe.dispatch, x, bad, mesh, num_experts=4, capacity_factor=2.0))
    # x and expert_ids of different lengths on rank 0
    xs = x[:3] if rank == 0 else x
    msgs.append(_raises(ValueError, r"EP rank 0 passed x with 3 rows but expert_ids has 4",
                        moe.dispatch, xs, ids, mesh, num_experts=4))
    # the style: num_tokens_per_expert disagrees with routed_input on rank 1
    experts = parallelize_module(_Experts(4, DIM), mesh, moe.ExpertParallel())
    counts = torch.tensor([1, 1, 1, 1]) if rank == 0 else torch.tensor([1, 2, 1, 1])
    msgs.append(_raises(ValueError, r"EP rank 1 passed routed_input with 4 rows but num_tokens_per_expert sums "
                                    r"to 5",
                        experts, x, counts))
    msgs.append(_raises(ValueError, r"num_tokens_per_expert must be a 1-D tensor of 4 counts",
                        experts, x, torch.tensor([4])))
    neg = torch.tensor([2, 2, 1, -1]) if rank == 1 else torch.tensor([1, 1, 1, 1])
    msgs.append(_raises(ValueError, r"EP rank 1 passed 1 negative entries in num_tokens_per_expert", experts, x, neg))
    # the exchange still works after the errors (no rank left in a collective)
    out = experts(x, torch.tensor([1, 1, 1, 1]))
    assert out.shape == x.shape
    return msgs


def _bad_mesh():
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    msgs = [_raises(ValueError, r"the EP mesh spans mesh dim 'tp', a model-parallel dim",
                    parallelize_module, _Experts(4, DIM), mesh["tp"], moe.ExpertParallel())]
    msgs.append(_raises(ValueError, r"the EP mesh spans mesh dim 'tp'", moe.dispatch,
                        torch.zeros(2, DIM), torch.zeros(2, 1, dtype=torch.long), mesh["tp"], num_experts=2))
    msgs.append(_raises(ValueError, r"needs a 2-D \('ep', 'tp'\) mesh",
                        parallelize_module, _Experts(4, DIM), mesh["dp"], moe.ExpertTensorParallel()))
    msgs.append(_raises(ValueError, r"the EP mesh must be 1-D",
                        moe.ExpertParallel().apply, _Experts(4, DIM), mesh))
    return msgs


def test_bad_input(dist_runner):
    msgs = dist_runner.run(2, _bad_inputs)
    assert msgs[0] == msgs[1]                   # every rank raised the same errors
    msgs = dist_runner.run(4, _bad_mesh)
    assert all(len(m) == 4 for m in msgs)      # (the messages name each rank's own sub-mesh)
