"""Gradient reductions deferred to the end of the backward pass, one flat buffer per group.

Two kinds of parameter gradient need a reduction after the local backward:

* a replicated leaf consumed by an op whose gradient is partial over a group
  (the RMSNorm weight applied to sequence-sharded activations): its gradient
  must be *summed* over that group;
* a data-parallel parameter (:func:`hyper_parallel.tensor_parallel.replicate`):
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

A DTensor parameter (a leaf marked by :func:`mark_dtensor_leaf`) goes further,
as in PyTorch: its gradient is left *partial* after ``backward()``, with no
collective at all (``.grad`` reports ``Partial`` on that mesh dim). The sum is
taken the first time any such gradient is redistributed (the optimizer step,
``clip_grad_norm_``, ``full_tensor()``), for all of them at once in one flat
all_reduce per group (:func:`flush_pending`). A tensor hook on the leaf keeps
the pieces right when the same backward also brings an ordinary (full)
contribution: it adds ``1/n`` of it to each rank's piece. Parameters that
cannot stay partial (a plain tensor leaf, FSDP's unsharded parameters, a
gradient already holding full values, several partial groups) take the
end-of-backward reduction above.
"""
from __future__ import annotations

import threading
import weakref

import torch

from hyper_parallel.distributed import collectives as C

_lock = threading.Lock()
_tasks = {}  # graph task id -> {"sum": {...}, "avg": {...}, "partial": {...}}
_seq = [0]
# gradients left partial after backward: id(leaf) -> [weakref(leaf), group, [weakref(grad view), ...]]
_pending = {}


def _order(tensor):
    """A per-tensor sequence number (assigned on first use) so every rank flattens in the same order."""
    s = getattr(tensor, "_hp_defer_seq", None)
    if s is None:
        with _lock:
            _seq[0] += 1
            s = tensor._hp_defer_seq = _seq[0]
    return s


def _queue(task: int):
    pending = _tasks.get(task)
    if pending is None:
        pending = _tasks[task] = {"sum": {}, "avg": {}, "partial": {}}
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _flush(task))
    return pending


def _will_accumulate(acc_node) -> bool:
    """True when the running backward will accumulate into this leaf (``backward()``, not ``autograd.grad``)."""
    try:
        return bool(torch._C._will_engine_execute_node(acc_node))
    except RuntimeError:  # autograd.grad(): leaves are captured, never accumulated
        return False


def mark_dtensor_leaf(local) -> None:
    """Mark ``local`` as the local tensor of a DTensor leaf: its partial gradients may stay partial."""
    if local.requires_grad and local.is_leaf:
        local._hp_dtensor_leaf = True


class DeferredPartialGrad(torch.autograd.Function):
    """Identity forward on a leaf; backward sums the gradient over ``group`` once, later.

    A DTensor leaf keeps its gradient partial (summed on first use, see
    :func:`flush_pending`); another leaf is summed at the end of backward. Falls
    back to an immediate all_reduce when the gradient will not be accumulated into
    the leaf (``autograd.grad``) or a graph of the gradient is being built
    (``create_graph=True``).
    """

    @staticmethod
    def forward(ctx, tensor, group, leave_partial=True):
        ctx.group = group
        ctx.leaf = tensor
        ctx.leave_partial = leave_partial
        _order(tensor)
        if leave_partial and getattr(tensor, "_hp_dtensor_leaf", False) \
                and not getattr(tensor, "_hp_partial_hook", False):
            tensor.register_hook(_leaf_hook(weakref.ref(tensor)))
            tensor._hp_partial_hook = True
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad_output):
        task = torch._C._current_graph_task_id()
        acc = ctx.next_functions[0][0]
        if task < 0 or torch.is_grad_enabled() or not _will_accumulate(acc):
            return C.all_reduce(grad_output, ctx.group, "sum"), None, None
        leaf = ctx.leaf
        d = grad_output.detach().clone()  # the engine may accumulate into g in place
        with _lock:
            pend = _queue(task)
            if ctx.leave_partial and getattr(leaf, "_hp_partial_hook", False):
                leaf._hp_acc_node = acc
                per_group = pend["partial"].setdefault(id(leaf), (leaf, {}))[1]
                prev = per_group.get(ctx.group.ranks)
                per_group[ctx.group.ranks] = (ctx.group, d if prev is None else prev[1] + d)
            else:
                key = (id(leaf), ctx.group.ranks)
                prev = pend["sum"].get(key)
                pend["sum"][key] = (leaf, ctx.group, d if prev is None else prev[2] + d)
        return grad_output, None, None


def _leaf_hook(ref):
    """Tensor hook of a DTensor leaf with partial gradients: keeps ``.grad`` a set of pieces summing to it.

    Runs once per backward with the leaf's whole incoming gradient (partial plus
    ordinary contributions), before it is accumulated.
    """
    def hook(incoming):
        leaf = ref()
        if leaf is None:
            return incoming
        task = torch._C._current_graph_task_id()
        with _lock:
            pend = _tasks.get(task)
            popped = pend["partial"].pop(id(leaf), None) if pend is not None else None
        entries = popped[1] if popped is not None else None
        entry = _pending.get(id(leaf))
        if entry is not None and (leaf.grad is None or entry[0]() is not leaf):
            _pending.pop(id(leaf), None)  # the old gradient was dropped (zero_grad)
            entry = None
        summed = pend is not None and any(k[0] == id(leaf) for k in pend["sum"])  # another path sums a part
        if entries is None:
            # only ordinary contributions this time; on top of pieces, each rank adds 1/n of them
            acc = getattr(leaf, "_hp_acc_node", None)
            if entry is not None and acc is not None and _will_accumulate(acc):
                if summed:  # part of it is summed at the end of backward: sum the pieces first
                    flush_pending()
                    return incoming
                return incoming / entry[1].size
            return incoming
        if len(entries) == 1 and not summed and (leaf.grad is None or entry is not None):
            group, d = next(iter(entries.values()))
            if entry is None or entry[1].ranks == group.ranks:
                if entry is None:
                    _pending[id(leaf)] = [ref, group, []]
                # the pieces: this rank's partial part plus 1/n of any ordinary part
                return d + (incoming - d) / group.size
        # cannot stay partial (another group, or full values already in .grad): sum at the end
        # of this backward, after any earlier pieces are summed
        if entry is not None:
            flush_pending()
        with _lock:
            sums = _queue(task)["sum"]
            for ranks, (group, d) in entries.items():
                sums[(id(leaf), ranks)] = (leaf, group, d)
        return incoming
    return hook


def partial_group(leaf):
    """The group ``leaf.grad`` is partial over (left so by backward), or None."""
    entry = _pending.get(id(leaf))
    if entry is None or entry[0]() is not leaf or leaf.grad is None:
        return None
    return entry[1]


def note_view(leaf, view) -> None:
    """``view`` shows ``leaf.grad`` as partial; :func:`flush_pending` relabels it (``view._hp_grad_reduced()``)."""
    entry = _pending.get(id(leaf))
    if entry is not None:
        entry[2].append(weakref.ref(view))


def forget(leaf) -> None:
    """``leaf.grad`` was replaced or dropped: it no longer holds partial pieces."""
    _pending.pop(id(leaf), None)


def has_pending() -> bool:
    return bool(_pending)


def flush_pending() -> None:
    """Sum every gradient left partial, one flat all_reduce per (group, dtype), in place.

    Collective: every rank of each group must call it at the same point (it runs
    when a partial gradient is first redistributed, which SPMD programs do alike).
    """
    with _lock:
        items = list(_pending.values())
        _pending.clear()
    live = [(leaf, group, views) for ref, group, views in items
            if (leaf := ref()) is not None and leaf.grad is not None]
    if not live:
        return
    with torch.no_grad():
        for bucket in _buckets(live):
            grads = [leaf.grad for leaf, _, _ in bucket]
            for g, r in zip(grads, _flat_reduce(grads, bucket[0][1], "sum")):
                g.copy_(r)
    for _, _, views in live:
        for v in views:
            v = v()
            if v is not None:
                v._hp_grad_reduced()


def defer_average(tensor, group) -> None:
    """Average ``tensor.grad`` over ``group`` at the end of the running backward (call from a grad hook)."""
    task = torch._C._current_graph_task_id()
    if task < 0:  # not inside backward (a hook run by hand): reduce now
        tensor.grad.copy_(C.all_reduce(tensor.grad, group, "avg", "data-parallel gradient all_reduce"))
        return
    _order(tensor)
    with _lock:
        _queue(task)["avg"][(id(tensor), group.ranks)] = (tensor, group)


def sum_incoming_grads(leaf, group, scale: float = 1.0) -> None:
    """Sum each gradient that backward brings to plain leaf ``leaf`` over ``group``, times ``scale``.

    HyperParallel's ``hsdp`` convention for replicated parameters: every incoming
    gradient (not the accumulated ``.grad``) is all-reduced with a plain sum and
    multiplied by ``grad_scale``. Inside ``backward()`` the sums of a pass are
    taken together at its end, one flat all_reduce per (group, dtype), as a
    correction ``allreduce(d) - d`` on top of what was accumulated, so gradient
    accumulation over several passes stays exact.
    """
    def hook(grad):
        if scale != 1.0:
            grad = grad * scale
        task = torch._C._current_graph_task_id()
        acc = getattr(leaf_ref(), "_hp_acc_node", None) if leaf_ref() is not None else None
        if task < 0 or (acc is not None and not _will_accumulate(acc)):
            return C.all_reduce(grad, group, "sum")  # outside backward or autograd.grad(): now
        lf = leaf_ref()
        if lf is not None:
            _order(lf)
            with _lock:
                _queue(task)["sum"][(id(lf), group.ranks)] = (lf, group, grad)
        return grad

    leaf_ref = weakref.ref(leaf)
    if leaf.is_leaf and getattr(leaf, "_hp_acc_node", None) is None:
        try:
            leaf._hp_acc_node = leaf.view_as(leaf).grad_fn.next_functions[0][0]
        except (AttributeError, IndexError, RuntimeError):
            pass
    leaf.register_hook(hook)


def _buckets(items):
    """Group ``(tensor, group, ...)`` entries by (group ranks, dtype, device), each sorted by sequence number."""
    out = {}
    for item in sorted(items, key=lambda it: (it[1].ranks, _order(it[0]))):
        t = item[0]
        out.setdefault((item[1].ranks, t.dtype, t.device), []).append(item)
    return [out[k] for k in sorted(out, key=lambda k: (k[0], str(k[1]), str(k[2])))]


def _flat_reduce(tensors, group, reduction):
    what = "deferred gradient all_reduce (pending Partial gradients)"
    if len(tensors) == 1:
        return [C.all_reduce(tensors[0], group, reduction, what)]
    flat = C.all_reduce(torch.cat([x.reshape(-1) for x in tensors]), group, reduction, what)
    return [piece.view_as(x) for piece, x in zip(flat.split([x.numel() for x in tensors]), tensors)]


def _flush(task: int) -> None:
    with _lock:
        pending = _tasks.pop(task, None)
    if pending is None:
        return
    for leaf, entries in pending["partial"].values():  # not consumed by the leaf's hook (not expected)
        for ranks, (group, d) in entries.items():
            pending["sum"][(id(leaf), ranks)] = (leaf, group, d)
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


def pending_sums(task: int) -> frozenset:
    """``id``s of the leaves whose partial sums backward pass ``task`` has queued for its end.

    (Graph task ids: ``torch._C._current_graph_task_id()``.) A consumer that must act
    only after those sums (FSDP reduces a group's gradients) asks whether its leaves
    are among them and, if so, waits for :func:`flush` instead of acting now.
    """
    with _lock:
        pending = _tasks.get(task)
        if not pending or not pending["sum"]:
            return frozenset()
        return frozenset(key[0] for key in pending["sum"])


def flush(task: int) -> None:
    """Run now the end-of-backward reductions that backward pass ``task`` queued (collective).

    The engine callback queued for ``task`` then finds nothing left to do, so a consumer
    whose own end-of-backward callback needs the sums first (FSDP's root) calls this
    before it reduces. A task with nothing queued is a no-op.
    """
    _flush(task)


def pending_tasks() -> int:
    """Number of backward passes with reductions still queued (0 outside backward; for tests)."""
    with _lock:
        return len(_tasks)
