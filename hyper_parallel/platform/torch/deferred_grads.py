"""Gradient reductions deferred to the end of the backward pass, one flat buffer per group.

Two kinds of parameter gradient need a reduction after the local backward:

* a replicated leaf consumed by an op whose gradient is partial over a group
  (the RMSNorm weight applied to sequence-sharded activations): its gradient
  must be *summed* over that group;
* a data-parallel parameter (:func:`hyper_parallel.core.tensor_parallel.replicate`):
  its gradient must be *averaged* over the dp group.

Reducing each parameter as its gradient appears costs one collective per
parameter. Megatron instead reduces all layernorm gradients once per step in
one flat buffer (``allreduce_layernorm_grads``), and DDP buckets dp gradients.
This module does the same inside ``backward()``: the first such gradient of a
backward pass queues one autograd-engine callback; when the graph has finished
(every gradient accumulated), the callback issues one all_reduce per
(group, dtype) and updates ``.grad`` in place.

The partial sum is applied as a correction: the engine accumulates the local
(partial) gradient ``d`` as usual, then the callback adds ``allreduce(d) - d``.
That stays right when the parameter also has ordinary uses in the same graph
and when gradients accumulate over several backward passes, and it leaves
``autograd.grad`` (which accumulates nothing) on the immediate all_reduce path.
Between the end of the graph and the callback, tensor hooks and
post-accumulate-grad hooks of such a parameter see the partial gradient; after
``backward()`` returns, ``.grad`` is the full one.
"""
from __future__ import annotations

import threading

import torch

from hyper_parallel.platform.torch import collectives as C

_lock = threading.Lock()
_tasks = {}  # graph task id -> {"sum": {...}, "avg": {...}}
_seq = [0]


def _order(t):
    """A per-tensor sequence number (assigned on first use) so every rank flattens in the same order."""
    s = getattr(t, "_hp_defer_seq", None)
    if s is None:
        with _lock:
            _seq[0] += 1
            s = t._hp_defer_seq = _seq[0]
    return s


def _queue(task: int):
    pending = _tasks.get(task)
    if pending is None:
        pending = _tasks[task] = {"sum": {}, "avg": {}}
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _flush(task))
    return pending


def _will_accumulate(acc_node) -> bool:
    """True when the running backward will accumulate into this leaf (``backward()``, not ``autograd.grad``)."""
    try:
        return bool(torch._C._will_engine_execute_node(acc_node))
    except RuntimeError:  # autograd.grad(): leaves are captured, never accumulated
        return False


class DeferredPartialGrad(torch.autograd.Function):
    """Identity forward on a leaf; backward sums the gradient over ``group`` once, at the end of backward.

    Falls back to an immediate all_reduce when the gradient will not be
    accumulated into the leaf (``autograd.grad``) or a graph of the gradient is
    being built (``create_graph=True``).
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.leaf = x
        _order(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        task = torch._C._current_graph_task_id()
        if task < 0 or torch.is_grad_enabled() or not _will_accumulate(ctx.next_functions[0][0]):
            return C.all_reduce(g, ctx.group, "sum"), None
        leaf = ctx.leaf
        with _lock:
            pend = _queue(task)["sum"]
            key = (id(leaf), ctx.group.ranks)
            prev = pend.get(key)
            d = g.detach().clone()  # the engine may accumulate into g in place
            pend[key] = (leaf, ctx.group, d if prev is None else prev[2] + d)
        return g, None


def defer_average(t, group) -> None:
    """Average ``t.grad`` over ``group`` at the end of the running backward (call from a grad hook)."""
    task = torch._C._current_graph_task_id()
    if task < 0:  # not inside backward (a hook run by hand): reduce now
        t.grad.copy_(C.all_reduce(t.grad, group, "avg"))
        return
    _order(t)
    with _lock:
        _queue(task)["avg"][(id(t), group.ranks)] = (t, group)


def _buckets(items):
    """Group ``(tensor, group, ...)`` entries by (group ranks, dtype, device), each sorted by sequence number."""
    out = {}
    for item in sorted(items, key=lambda it: (it[1].ranks, _order(it[0]))):
        t = item[0]
        out.setdefault((item[1].ranks, t.dtype, t.device), []).append(item)
    return [out[k] for k in sorted(out, key=lambda k: (k[0], str(k[1]), str(k[2])))]


def _flat_reduce(tensors, group, op):
    if len(tensors) == 1:
        return [C.all_reduce(tensors[0], group, op)]
    flat = C.all_reduce(torch.cat([x.reshape(-1) for x in tensors]), group, op)
    return [piece.view_as(x) for piece, x in zip(flat.split([x.numel() for x in tensors]), tensors)]


def _flush(task: int) -> None:
    with _lock:
        pending = _tasks.pop(task, None)
    if pending is None:
        return
    with torch.no_grad():
        # 1. partial sums: .grad already holds d; add allreduce(d) - d
        for bucket in _buckets(pending["sum"].values()):
            reduced = _flat_reduce([d for _, _, d in bucket], bucket[0][1], "sum")
            for (leaf, _, d), r in zip(bucket, reduced):
                if leaf.grad is not None:  # None only if a hook cleared it
                    leaf.grad.add_(r - d)
        # 2. data-parallel averages of the (now complete) gradients
        for bucket in _buckets(pending["avg"].values()):
            grads = [t.grad for t, _ in bucket if t.grad is not None]
            if not grads:
                continue
            for g, r in zip(grads, _flat_reduce(grads, bucket[0][1], "avg")):
                g.copy_(r)


def pending_tasks() -> int:
    """Number of backward passes with reductions still queued (0 outside backward; for tests)."""
    with _lock:
        return len(_tasks)
