"""Every differentiable collective of the platform layer, on 2 and 4 ranks.

Each case runs the collective on every rank of a group and compares this rank's
output and input gradient (fp64) with a single-process reference that holds all
ranks' inputs as separate leaves. The reference spells out the gradient
convention of the function under test:

* layout collectives (DTensor convention): a Replicate / Partial value is one
  logical tensor, so its upstream gradient is the same on every rank and the
  loss counts it once; a Replicate *input* is one leaf shared by all ranks;
* rooted and point-to-point collectives: every rank's output is its own tensor
  and the loss is the sum of all ranks' losses.

``torch.autograd.gradcheck`` is not used: it perturbs one rank's input while the
other ranks perturb theirs in the same collective calls, so its numerical
Jacobian would mix ranks; the references here are exact autograd on one process.
On 4 ranks every case also runs on the groups {0, 2} and {1, 3}, where a group
rank differs from the global rank (``src``/``dst`` arguments are global ranks).
"""
import pytest
import torch
import torch.distributed as dist

from hyper_parallel.debug import CommDebugMode
from hyper_parallel.platform import get_platform

DT = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _chunks(n, k):
    return [c.shape[0] for c in torch.arange(n).chunk(k)] + [0] * (k - len(torch.arange(n).chunk(k)))


def _narrow(t, dim, sizes, i):
    return t.narrow(dim, sum(sizes[:i]), sizes[i])


REDUCE = {"sum": lambda s: s.sum(0), "avg": lambda s: s.mean(0), "max": lambda s: s.amax(0),
          "min": lambda s: s.amin(0), "prod": lambda s: s.prod(0)}


def _with_zeros(xs):
    """Zeros for Partial(prod): one rank has a zero, and two ranks share another."""
    xs = [x.clone() for x in xs]
    xs[1][0, 0] = 0.0
    xs[0][1, 1] = 0.0
    xs[-1][1, 1] = 0.0
    return xs


def _cases(k):
    """(name, make_inputs(k) -> per-rank inputs, dist_fn(x, group), ref(xs, ws) -> (ys, loss), flags)."""
    F = get_platform().functions
    C = get_platform().collectives
    s5 = _chunks(5, k)      # uneven (and on 4 ranks an empty piece): 3,2 / 2,2,1,0
    s7 = _chunks(7, k)
    cases = []

    def per_rank(seed, shape_of):
        return lambda g: [_rand(seed + r, *shape_of(i)) for i, r in enumerate(g.ranks)]

    def replicated(seed, *shape):
        return lambda g: [_rand(seed, *shape)] * g.size

    # all_gather: Shard -> Replicate (own-chunk backward) and Megatron's reduce_scatter backward
    cases.append(("all_gather/split-bwd", per_rank(10, lambda i: (2, s5[i])),
                  lambda x, g: F.AllGather.apply(x, 1, g, s5, False),
                  lambda xs, ws: ([torch.cat(xs, 1)] * k, (ws[0] * torch.cat(xs, 1)).sum()), "same_w"))
    cases.append(("all_gather/rs-bwd", per_rank(20, lambda i: (s5[i], 3)),
                  lambda x, g: F.AllGather.apply(x, 0, g, s5, True),
                  lambda xs, ws: ([torch.cat(xs, 0)] * k, sum((w * torch.cat(xs, 0)).sum() for w in ws)), ""))
    cases.append(("gathered_partial_grad", per_rank(25, lambda i: (s5[i], 3)),
                  lambda x, g: F.GatheredPartialGrad.apply(x, C.all_gather(x.detach(), 0, g, s5), 0, g, s5),
                  lambda xs, ws: ([torch.cat(xs, 0)] * k, sum((w * torch.cat(xs, 0)).sum() for w in ws)), ""))
    # split: Replicate -> Shard, gradient all-gathered (the full gradient of the replicated input)
    cases.append(("split", replicated(30, 2, 5),
                  lambda x, g: F.Split.apply(x, 1, g, s5),
                  lambda xs, ws: ([_narrow(xs[0], 1, s5, i) for i in range(k)],
                                  sum((w * _narrow(xs[0], 1, s5, i)).sum() for i, w in enumerate(ws))), "rep_in"))
    # all_reduce: Partial(op) -> Replicate
    for op, red in REDUCE.items():
        make = per_rank(40, lambda i: (3, 4))
        if op == "prod":
            make = (lambda m: lambda g: _with_zeros(m(g)))(make)
        cases.append((f"all_reduce/{op}", make,
                      (lambda op: lambda x, g: F.AllReduce.apply(x, g, op))(op),
                      (lambda red: lambda xs, ws: ([red(torch.stack(xs))] * k, (ws[0] * red(torch.stack(xs))).sum()))(red),
                      "same_w"))
    # reduce_scatter: Partial(op) -> Shard(1), uneven
    for op, red in REDUCE.items():
        make = per_rank(50, lambda i: (3, 5))
        if op == "prod":
            make = (lambda m: lambda g: _with_zeros(m(g)))(make)

        def ref(xs, ws, red=red):
            full = red(torch.stack(xs))
            ys = [_narrow(full, 1, s5, i) for i in range(k)]
            return ys, sum((w * y).sum() for w, y in zip(ws, ys))
        cases.append((f"reduce_scatter/{op}", make,
                      (lambda op: lambda x, g: F.ReduceScatter.apply(x, 1, g, s5, op))(op), ref, ""))
    # all_to_all: Shard(0) -> Shard(1), uneven both ways

    def ref_a2a(xs, ws):
        full = torch.cat(xs, 0)
        ys = [_narrow(full, 1, s7, i) for i in range(k)]
        return ys, sum((w * y).sum() for w, y in zip(ws, ys))
    cases.append(("all_to_all", per_rank(60, lambda i: (s5[i], 7)),
                  lambda x, g: F.AllToAll.apply(x, 1, 0, g, s7, s5), ref_a2a, ""))
    # Replicate -> Partial: pieces reduce back to the input; gradient passes through
    for op in ("sum", "avg", "max", "prod"):
        def ref_r2p(xs, ws, op=op):
            x = xs[0]
            pieces = {"sum": [x] + [x * 0] * (k - 1), "prod": [x] + [x * 0 + 1] * (k - 1)}.get(op, [x] * k)
            return pieces, (ws[0] * x).sum()
        cases.append((f"replicate_to_partial/{op}", replicated(70, 3, 2),
                      (lambda op: lambda x, g: F.ReplicateToPartial.apply(x, g, op))(op), ref_r2p, "rep_in same_w"))
    # identity forward, all_reduce(sum) of partial gradients backward
    cases.append(("partial_grad", replicated(80, 3, 2), lambda x, g: F.PartialGrad.apply(x, g),
                  lambda xs, ws: ([xs[0]] * k, sum((w * xs[0]).sum() for w in ws)), "rep_in"))
    # broadcast from the last group rank: every rank's output is its own tensor
    cases.append(("broadcast", per_rank(90, lambda i: (3, 2)),
                  lambda x, g: F.Broadcast.apply(x, g, g.ranks[-1]),
                  lambda xs, ws: ([xs[-1]] * k, sum((w * xs[-1]).sum() for w in ws)), ""))
    # scatter from group rank 1 along dim 1 (uneven); the other ranks' inputs are ignored

    def ref_scatter(xs, ws):
        ys = [_narrow(xs[1], 1, s5, i) for i in range(k)]
        return ys, sum((w * y).sum() for w, y in zip(ws, ys))
    cases.append(("scatter", per_rank(100, lambda i: (2, 5)),
                  lambda x, g: F.Scatter.apply(x, 1, g, g.ranks[1], s5), ref_scatter, ""))
    cases.append(("scatter/default-sizes", per_rank(105, lambda i: (5, 2)),
                  lambda x, g: F.Scatter.apply(x, 0, g, g.ranks[1]),
                  lambda xs, ws: ([_narrow(xs[1], 0, s5, i) for i in range(k)],
                                  sum((w * _narrow(xs[1], 0, s5, i)).sum() for i, w in enumerate(ws))), ""))
    return cases


def _check_case(name, make, fn, ref, flags, group):
    k, me = group.size, group.rank
    xs_val = make(group)
    leaves = [x.detach().clone().requires_grad_() for x in xs_val]
    xs = [leaves[0]] * k if "rep_in" in flags else leaves
    shapes = [y.shape for y in ref([x.detach() for x in xs], [0.0] * k)[0]]
    # upstream gradients: one per rank, or one shared by all (a Replicate / Partial output's gradient)
    if "same_w" in flags:
        ws = [_rand(7000, *shapes[0])] * k
    else:
        ws = [_rand(7000 + group.ranks[i], *shapes[i]) for i in range(k)]
    ys, loss = ref(xs, ws)
    loss.backward()
    x = xs_val[me].detach().clone().requires_grad_()
    y = fn(x, group)
    torch.testing.assert_close(y, ys[me].detach(), msg=lambda m: f"{name} value on group rank {me}\n{m}", **TOL)
    (ws[me] * y).sum().backward()
    want = xs[me].grad if xs[me].grad is not None else torch.zeros_like(x)
    assert x.grad is not None, f"{name}: no gradient on group rank {me}"
    torch.testing.assert_close(x.grad, want, msg=lambda m: f"{name} grad on group rank {me}\n{m}", **TOL)


def _send_recv(group):
    """Ring: group rank i sends x_i to i+1 and receives from i-1 (differentiable both ways)."""
    F = get_platform().functions
    k, me = group.size, group.rank
    nxt, prv = group.ranks[(me + 1) % k], group.ranks[(me - 1) % k]
    x = _rand(300 + group.ranks[me], 2, 3).requires_grad_()
    w = _rand(400 + group.ranks[me], 2, 3)
    w_next = _rand(400 + nxt, 2, 3)
    # even group ranks send first, odd ones receive first (blocking point-to-point)
    if me % 2 == 0:
        token = F.send(x, nxt, group)
        y = F.recv((2, 3), prv, group, dtype=DT)
    else:
        y = F.recv((2, 3), prv, group, dtype=DT)
        token = F.send(x, nxt, group)
    torch.testing.assert_close(y, _rand(300 + prv, 2, 3), **TOL)
    assert y.requires_grad and token.requires_grad and token.shape == ()
    steps = [lambda: token.backward(), lambda: (w * y).sum().backward()]
    for step in (steps if me % 2 == 0 else steps[::-1]):
        step()
    # d(sum_i <w_i, y_i>)/dx_i = w_{i+1}
    torch.testing.assert_close(x.grad, w_next, **TOL)


def _counts(group):
    """Collectives issued forward and backward by the functions whose backward communicates."""
    F = get_platform().functions
    k = group.size
    x = _rand(500 + dist.get_rank(), 4, 3).requires_grad_()
    with CommDebugMode() as comm:
        F.AllReduce.apply(x, group, "prod").sum().backward()
    assert comm.get_comm_counts() == {"all_reduce": 1, "all_to_all": 2}, comm.get_comm_counts()
    with CommDebugMode() as comm:
        F.ReduceScatter.apply(x, 0, group, _chunks(4, k), "max").sum().backward()
    assert comm.get_comm_counts() == {"reduce_scatter": 1, "all_gather": 1}, comm.get_comm_counts()
    with CommDebugMode() as comm:
        F.Broadcast.apply(x, group, group.ranks[0]).sum().backward()
    assert comm.get_comm_counts() == {"broadcast": 1, "reduce": 1}, comm.get_comm_counts()
    with CommDebugMode() as comm:
        F.Scatter.apply(x, 0, group, group.ranks[0]).sum().backward()
    assert comm.get_comm_counts() == {"scatter": 1, "gather": 1}, comm.get_comm_counts()


def _ties(group):
    """Partial(max/min) with ties: every tied rank gets the full gradient (masked, not split)."""
    F = get_platform().functions
    x = torch.ones(3, dtype=DT, requires_grad=True)
    w = _rand(600, 3)
    for op in ("max", "min"):
        x.grad = None
        (w * F.AllReduce.apply(x, group, op)).sum().backward()
        torch.testing.assert_close(x.grad, w, **TOL)


def _errors(group):
    F = get_platform().functions
    with pytest.raises(ValueError, match=rf"Scatter: sizes=\[1, 1\] must have {group.size} entries summing to "
                       r"x.shape\[0\]=5"):
        F.Scatter.apply(torch.zeros(5), 0, group, group.ranks[0], [1, 1])
    with pytest.raises(ValueError, match="reduce_op='median' is not supported"):
        F.ReduceScatter.apply(torch.zeros(4), 0, group, _chunks(4, group.size), "median")


def _all():
    plat = get_platform()
    ws = dist.get_world_size()
    groups = [plat.new_group(range(ws))]
    if ws == 4:
        sub = [plat.new_group((0, 2)), plat.new_group((1, 3))]
        groups.append(next(g for g in sub if g.rank >= 0))
    n = 0
    for group in groups:
        for name, make, fn, ref, flags in _cases(group.size):
            _check_case(name, make, fn, ref, flags, group)
            n += 1
        _send_recv(group)
        _counts(group)
        _ties(group)
    _errors(groups[0])
    return n


@pytest.mark.parametrize("world_size", [2, 4])
def test_differentiable_collectives(dist_runner, world_size):
    counts = dist_runner.run(world_size, _all)
    assert counts == [23 * (1 if world_size == 2 else 2)] * world_size
