"""SkipDTensorDispatch: run ops on DTensors as plain local-tensor ops."""
from __future__ import annotations

from typing import Iterable, Optional

from hyper_parallel.core.dtensor.dtensor import settle_pending_grads
from hyper_parallel.core.shard._op_dispatch import disable_dtensor_dispatch, enable_dtensor_dispatch
from hyper_parallel.platform import get_platform


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
        entries = set()
        for op in no_skip or ():
            if isinstance(op, str):
                entries.add(op)
            elif callable(op):
                entries.add(op)
                entries.add(get_platform().op_name(op))
            else:
                raise TypeError(f"SkipDTensorDispatch(no_skip=...): entries must be callables or op names, got {op!r}")
        self._no_skip = frozenset(entries)

    def __enter__(self):
        settle_pending_grads()
        disable_dtensor_dispatch(self._no_skip)
        return self

    def __exit__(self, *exc):
        enable_dtensor_dispatch()
        return False
