"""The two switches the DTensor layer itself reads: ``SkipDTensorDispatch`` and ``implicit_replication``.

Named for what it holds (it was ``dispatch_state.py``; a module called "dispatch" is op dispatch,
``hyper_parallel.dispatch``): the skip state (ops on DTensors run on their local tensors) and the
implicit-replication flag (plain tensors mixed with DTensors are replicated).

The op dispatcher (``dispatch/dispatcher.py``, one layer up) reads this state on
every call; ``DTensor.__torch_dispatch__`` (this layer) uses ``implicit_replication``
for ``torch.vmap``. Their public home is :mod:`hyper_parallel.dispatch.modes`,
which re-exports these very objects (identity preserved).

* ``SkipDTensorDispatch``: a per-thread stack of contexts (``SKIP_ANY[0]`` counts
  active contexts in all threads, a fast check before the thread-local).
* HyperParallel's process-wide no-skip set (``add_no_skip_ops``).
* ``implicit_replication``: process-global, ``IMPLICIT_REPLICATION[0]``.
"""
from __future__ import annotations

import threading
from typing import Iterable, Optional

from hyper_parallel.dtensor.grad_state import settle_pending_grads
from hyper_parallel.dtensor import torch_internals

_tls = threading.local()

SKIP_ANY = [0]  # active SkipDTensorDispatch contexts in any thread (fast check before the thread-local)
_SKIP_LOCK = threading.Lock()
# HyperParallel's process-wide no-skip set (add_no_skip_ops / remove_no_skip_ops): ops still dispatched
# inside every SkipDTensorDispatch context, on top of each context's own ``no_skip``
NO_SKIP_GLOBAL = [frozenset()]
IMPLICIT_REPLICATION = [False]


def skip_state():
    """This thread's ``[depth, [no_skip set per context]]``."""
    st = getattr(_tls, "skip", None)
    if st is None:
        st = _tls.skip = [0, []]
    return st


def current_skip():
    """This thread's skip state when a SkipDTensorDispatch context is active in it, else None."""
    st = getattr(_tls, "skip", None)
    return st if st is not None and st[0] > 0 else None


def disable_dtensor_dispatch(no_skip=()):
    st = skip_state()
    st[0] += 1
    st[1].append(frozenset(no_skip))
    with _SKIP_LOCK:
        SKIP_ANY[0] += 1


def get_dtensor_dispatch() -> bool:
    """Whether DTensor dispatch is on in this thread (no ``SkipDTensorDispatch`` /
    ``disable_dtensor_dispatch()`` active); HyperParallel's name."""
    return current_skip() is None


def enable_dtensor_dispatch():
    st = skip_state()
    st[0] -= 1
    st[1].pop()
    with _SKIP_LOCK:
        SKIP_ANY[0] -= 1


def _no_skip_entries(op_names, what):
    if isinstance(op_names, str) or callable(op_names):
        op_names = (op_names,)
    entries = set()
    try:
        items = list(op_names)
    except TypeError:
        raise TypeError(f"{what}: op_names must be a set of op names or callables, got {op_names!r}") from None
    for op in items:
        if isinstance(op, str):
            entries.add(op)
        elif callable(op):
            entries.add(op)
            entries.add(torch_internals.op_name(op))
        else:
            raise TypeError(f"{what}: entries must be op names or callables, got {op!r}")
    return entries


def get_no_skip_ops() -> frozenset:
    """The ops added with :func:`add_no_skip_ops` (HyperParallel's name)."""
    return NO_SKIP_GLOBAL[0]


def add_no_skip_ops(op_names) -> None:
    """Keep ``op_names`` (names such as ``"zeros_like"`` or callables) dispatched inside SkipDTensorDispatch.

    HyperParallel's process-wide set: it applies to every context, in every thread, until
    :func:`remove_no_skip_ops`; ``SkipDTensorDispatch(no_skip=...)`` is the per-context form.
    """
    NO_SKIP_GLOBAL[0] = NO_SKIP_GLOBAL[0] | _no_skip_entries(op_names, "add_no_skip_ops")


def remove_no_skip_ops(op_names) -> None:
    """Undo :func:`add_no_skip_ops` for ``op_names``."""
    NO_SKIP_GLOBAL[0] = NO_SKIP_GLOBAL[0] - _no_skip_entries(op_names, "remove_no_skip_ops")


class SkipDTensorDispatch:
    """Inside this context, ops on DTensors run on their local tensors and return local results.

    Ops listed in ``no_skip`` (callables such as ``torch.zeros_like`` or op names
    such as ``"zeros_like"``) still go through DTensor dispatch. Contexts nest;
    the state is per thread.

    Entering sums the parameter gradients that backward left ``Partial`` (SP norm
    weights, see ``docs/tensor_parallel.md``; one flat all_reduce for all of them),
    so code that reads local gradients here — HyperParallel's
    ``with SkipDTensorDispatch(): optimizer.step()`` — sees complete ones. Every
    rank must enter it at the same point when such gradients are pending.

    Example::

        with SkipDTensorDispatch(no_skip={torch.zeros_like}):
            local_sum = dt + dt                 # plain tensor: local shard + local shard
            z = torch.zeros_like(dt)            # still a DTensor
    """

    def __init__(self, no_skip: Optional[Iterable] = None):
        self._no_skip = frozenset(_no_skip_entries(no_skip or (), "SkipDTensorDispatch(no_skip=...)"))

    def __enter__(self):
        settle_pending_grads()
        disable_dtensor_dispatch(self._no_skip)
        return self

    def __exit__(self, *exc):
        enable_dtensor_dispatch()
        return False


class implicit_replication:
    """Inside, plain (non-0-d) tensors mixed with DTensors are treated as replicated."""

    def __enter__(self):
        self.prev = IMPLICIT_REPLICATION[0]
        IMPLICIT_REPLICATION[0] = True

    def __exit__(self, *exc):
        IMPLICIT_REPLICATION[0] = self.prev


__all__ = ["SkipDTensorDispatch", "implicit_replication", "disable_dtensor_dispatch", "enable_dtensor_dispatch",
           "get_dtensor_dispatch",
           "add_no_skip_ops", "remove_no_skip_ops", "get_no_skip_ops"]
