"""Python-level Tensor methods on DTensor (``a + b``, ``x @ w``, ``x.view(...)``): same results, fewer entries.

The methods defined by ``hyper_parallel.dtensor.fast_path`` skip the
C++ ``__torch_function__`` entry on a fast-cache hit. These tests check that a
hit really bypasses ``__torch_function__``, that the result (values, layout,
gradients, including partial gradients of replicated inputs) is the one the
ordinary path gives, and that every case the fast path does not cover (modes,
SkipDTensorDispatch, keyword arguments, misses) still goes through dispatch.
"""
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import hyper_parallel as hp
from hyper_parallel import Replicate, Shard
from hyper_parallel.dtensor import fast_path as _fast_methods
from hyper_parallel.dispatch import dispatcher as _op_dispatch

TOL = dict(rtol=1e-6, atol=1e-6)


class _Count:
    """Counts DTensor.__torch_function__ entries."""

    def __enter__(self):
        self.n = 0
        self.orig = hp.DTensor.__dict__["__torch_function__"]
        f = self.orig.__func__

        def counting(cls, func, types, args=(), kwargs=None):
            self.n += 1
            return f(cls, func, types, args, kwargs)
        hp.DTensor.__torch_function__ = classmethod(counting)
        return self

    def __exit__(self, *exc):
        hp.DTensor.__torch_function__ = self.orig


class _Seen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def _cases():
    ws = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4 * ws, 6, generator=g), torch.randn(4 * ws, 6, generator=g)
    w = torch.randn(6, 5, generator=g)
    dx, dy = hp.distribute_tensor(x, mesh, [Shard(0)]), hp.distribute_tensor(y, mesh, [Shard(0)])
    dw = hp.distribute_tensor(w, mesh, [Replicate()])
    calls = {
        "__add__": (lambda a, b: a + b, lambda a, b: a + b),
        "__mul__ scalar": (lambda a, b: a * 2.5, lambda a, b: a * 2.5),
        "__truediv__": (lambda a, b: a / b, lambda a, b: a / b),
        "__neg__": (lambda a, b: -a, lambda a, b: -a),
        "__pow__": (lambda a, b: a ** 2, lambda a, b: a ** 2),
        "sum(-1)": (lambda a, b: a.sum(-1), lambda a, b: a.sum(-1)),
        "softmax(-1)": (lambda a, b: a.softmax(-1), lambda a, b: a.softmax(-1)),
        "transpose(0, 1)": (lambda a, b: a.transpose(0, 1), lambda a, b: a.transpose(0, 1)),
        "exp().tanh()": (lambda a, b: a.exp().tanh(), lambda a, b: a.exp().tanh()),
        # rules with a local implementation (view of a sharded tensor computes the local shape)
        "view(-1, 3)": (lambda a, b: a.view(-1, 3), lambda a, b: a.view(-1, 3)),
        "unsqueeze(0).flatten(0, 1)": (lambda a, b: a.unsqueeze(0).flatten(0, 1),
                                       lambda a, b: a.unsqueeze(0).flatten(0, 1)),
        # a tuple argument is not a fast-key scalar: the ordinary path
        "view((-1, 3))": (lambda a, b: a.view((-1, 3)), lambda a, b: a.view((-1, 3))),
        "t().contiguous()": (lambda a, b: a.t().contiguous(), lambda a, b: a.t().contiguous()),
    }
    assert {"__add__", "__matmul__", "sum", "softmax"} <= set(_fast_methods.METHODS)
    for name, (f, ref) in calls.items():
        first = f(dx, dy)  # miss: through __torch_function__, fills the cache
        with _Count() as c:
            second = f(dx, dy)
        # every call in the expression hit a Python-level method, or (tuple argument) went through dispatch
        assert c.n == (1 if name == "view((-1, 3))" else 0), (name, c.n)
        assert second._layout == first._layout and second.shape == first.shape, name
        torch.testing.assert_close(second.full_tensor(), ref(x, y), **TOL, msg=name)

    # x @ w with w replicated: w's gradient is partial over tp; the fast path gives it the partial-grad view
    for _ in range(2):
        pw = torch.nn.Parameter(dw.detach().clone())
        px = dx.detach().clone().requires_grad_(True)
        out = px @ pw
        with _Count() as c:
            out2 = px @ pw
        assert c.n == 0
        (out + out2).sum().backward()
    rw, rx = w.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ((rx @ rw) * 2).sum().backward()
    torch.testing.assert_close(pw.grad.full_tensor(), rw.grad, **TOL)
    torch.testing.assert_close(px.grad.full_tensor(), rx.grad, **TOL)

    # a torch function mode sees the DTensor-level call, as without the fast methods
    _ = dx + dy
    with _Seen() as mode:
        r = dx + dy
    assert torch.Tensor.add in mode.funcs, mode.funcs
    torch.testing.assert_close(r.full_tensor(), x + y, **TOL)

    # scalar keyword arguments have a fast path too (no cached-path lookup on the second call): a
    # method skips __torch_function__, a torch function enters it once; other values: the ordinary path
    kw_calls = {
        "mean(-1, keepdim=True)": (lambda a: a.mean(-1, keepdim=True), lambda a: a.mean(-1, keepdim=True), 0),
        "F.softmax(dim=-1)": (lambda a: torch.nn.functional.softmax(a, dim=-1),
                              lambda a: torch.nn.functional.softmax(a, dim=-1), 1),
        "sum(dim=-1)": (lambda a: a.sum(dim=-1), lambda a: a.sum(dim=-1), 0),
        "torch.sum(dim=-1)": (lambda a: torch.sum(a, dim=-1), lambda a: torch.sum(a, dim=-1), 1),
    }
    for name, (f, ref, entries) in kw_calls.items():
        f(dx)
        stats = dict(_op_dispatch._STATS)
        with _Count() as c:
            r = f(dx)
        assert c.n == entries and _op_dispatch._STATS == stats, (name, c.n, stats, _op_dispatch._STATS)
        torch.testing.assert_close(r.full_tensor(), ref(x), **TOL, msg=name)
    stats = dict(_op_dispatch._STATS)
    r = dx.sum(dim=[0, 1])  # a list value: the ordinary (cached) path
    assert _op_dispatch._STATS["hits"] + _op_dispatch._STATS["misses"] == stats["hits"] + stats["misses"] + 1
    torch.testing.assert_close(r.full_tensor(), x.sum(dim=[0, 1]), **TOL)
    # a DTensor keyword argument (F.linear(x, weight=w), w replicated: partial gradient) takes the ordinary path
    pw = torch.nn.Parameter(hp.distribute_tensor(w.t().contiguous(), mesh, [Replicate()]))
    px = dx.detach().clone().requires_grad_(True)
    for _ in range(2):
        torch.nn.functional.linear(px, weight=pw).sum().backward()
    rw, rx = w.t().contiguous().requires_grad_(True), x.clone().requires_grad_(True)
    (torch.nn.functional.linear(rx, weight=rw).sum() * 2).backward()
    torch.testing.assert_close(pw.grad.full_tensor(), rw.grad, **TOL)
    torch.testing.assert_close(px.grad.full_tensor(), rx.grad, **TOL)

    # SkipDTensorDispatch and misses take the ordinary path
    with hp.SkipDTensorDispatch():
        local = dx + dy
    assert type(local) is torch.Tensor
    torch.testing.assert_close(local, dx.to_local() + dy.to_local())
    z = hp.distribute_tensor(torch.randn(4 * ws, 6, dtype=torch.float64, generator=g), mesh, [Shard(1)])
    with _Count() as c:  # S0 + S1: a miss with a redistribution, never fast
        r = dx.double() + z
    assert c.n >= 1
    torch.testing.assert_close(r.full_tensor(), x.double() + z.full_tensor())
    return True


def test_fast_methods_2(dist_runner):
    assert dist_runner.run(2, _cases) == [True, True]


def test_fast_methods_1(dist_runner):
    assert dist_runner.run(1, _cases) == [True]
