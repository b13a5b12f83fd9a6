"""PyTorch's ``register_sharding`` decorator on the ``DistributedOp`` registry.

``@register_sharding(op)`` registers a rule for ``op`` (an op overload such as
``torch.ops.aten.mm.default``, its packet, a torch function, or a list of them) built
from the decorated function, with PyTorch 2.13's contract: the function is called with
the op's arguments, each DTensor replaced by a spec (``.mesh``, ``.placements``,
``.shape``, ``.ndim``, ``.dtype``, ``.stride``, ``.tensor_meta``), and returns a sequence
of ``(output_placements, input_placements)`` pairs, each a list with one placement per
output / per positional argument (``None`` for non-tensor arguments) for **one** mesh dim.
As in PyTorch, every mesh dim picks one of the pairs independently and the combination
with the cheapest redistribution of the inputs wins (ties: the earliest). The rule
replaces any built-in rule of the same op name.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

from hyper_parallel.dtensor.dtensor import build_layout
from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, is_dtensor, meta_run, redistribution_cost
import torch

_MAX_COMBINATIONS = 1 << 14


class DTensorSpecLike:
    """What a registered sharding function sees for a DTensor argument (PyTorch passes a DTensorSpec)."""

    __slots__ = ("mesh", "placements", "shape", "dtype", "_stride")

    def __init__(self, dtensor):
        self.mesh = dtensor.device_mesh
        self.placements = tuple(dtensor.placements)
        self.shape = dtensor.shape
        self.dtype = dtensor.dtype
        self._stride = tuple(dtensor.stride())

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def stride(self):
        return self._stride

    @property
    def tensor_meta(self):
        return self

    def __repr__(self):
        return f"DTensorSpecLike(shape={tuple(self.shape)}, placements={self.placements})"


def _op_names(func) -> list:
    """The names under which calls of ``func`` reach the dispatcher."""
    names = []
    name = getattr(func, "__name__", None)
    if isinstance(name, str) and name:
        names.append(name)
        base = name.split(".")[0]  # an overload "mm.default": its packet "mm" (torch.mm, Tensor.mm)
        if base != name:
            names.append(base)
    packet = getattr(func, "overloadpacket", None)
    pname = getattr(packet, "__name__", None)
    if isinstance(pname, str) and pname and pname not in names:
        names.append(pname)
    if not names:
        raise TypeError(f"register_sharding(op): op must be an op overload, op packet or torch function, got {func!r}")
    return names


class RegisteredShardingRule(DistributedOp):
    """The rule ``register_sharding`` builds around a user's sharding function."""

    def __init__(self, op_name: str, sharding_fn: Callable):
        self.fn = sharding_fn
        super().__init__(op_name)

    def strategy(self, call):
        specs = [DTensorSpecLike(a) if is_dtensor(a) else a for a in call.args]
        kwargs = {k: DTensorSpecLike(v) if is_dtensor(v) else v for k, v in call.kwargs.items()}
        if any(is_dtensor(v) for v in call.kwargs.values()) or len(call.dtensor_args) != sum(
                is_dtensor(a) for a in call.args):
            raise NotImplementedError(f"register_sharding rule for {call.name!r}: DTensors must be top-level "
                                      "positional arguments (not in lists or keyword arguments)")
        choices = [self._check_pair(p, len(call.args)) for p in self.fn(*specs, **kwargs)]
        if not choices:
            raise ValueError(f"register_sharding rule for {call.name!r}: {self.fn.__name__} returned no "
                             "(output_placements, input_placements) pair")
        mesh = call.mesh
        n_comb = len(choices) ** mesh.ndim
        if n_comb > _MAX_COMBINATIONS:
            raise ValueError(f"register_sharding rule for {call.name!r}: {len(choices)} strategies over a "
                             f"{mesh.ndim}-d mesh give {n_comb} combinations (limit {_MAX_COMBINATIONS})")
        out_meta = meta_run(call.func, call.args, call.kwargs)
        single = not isinstance(out_meta, (tuple, list))
        outs = [out_meta] if single else list(out_meta)
        tensor_pos = [i for i, a in enumerate(call.args) if is_dtensor(a)]
        best = None
        for comb in itertools.product(choices, repeat=mesh.ndim):
            try:
                in_layouts = [build_layout(mesh, [c[1][i] for c in comb], call.args[i].ndim) for i in tensor_pos]
                out_layouts = [None if not hasattr(o, "shape") else
                               build_layout(mesh, [c[0][k] for c in comb], len(o.shape))
                               for k, o in enumerate(outs)]
            except (TypeError, ValueError, IndexError):
                continue  # e.g. a Shard dim the tensor does not have
            cost = sum(redistribution_cost(call.layouts[j], lay, call.shapes[j], call.itemsizes[j])
                       for j, lay in enumerate(in_layouts))
            if best is None or cost < best[0]:
                best = (cost, in_layouts, out_layouts)
        if best is None:
            raise ValueError(f"register_sharding rule for {call.name!r}: none of the strategies "
                             f"{[tuple(c) for c in choices]} is valid for input shapes {call.shapes}")
        _, in_layouts, out_layouts = best
        size = torch.Size
        shapes = [size(o.shape) if hasattr(o, "shape") else None for o in outs]
        if single:
            return Strategy(in_layouts, out_layouts[0], out_shapes=shapes[0])
        return Strategy(in_layouts, type(out_meta)(out_layouts), out_shapes=type(out_meta)(shapes))

    def _check_pair(self, pair, n_args):
        try:
            outs, ins = pair
            outs, ins = list(outs), list(ins)
        except (TypeError, ValueError):
            raise TypeError(f"register_sharding: {self.fn.__name__} must return (output_placements, "
                            f"input_placements) pairs, got {pair!r}") from None
        if len(ins) < n_args:
            ins += [None] * (n_args - len(ins))
        return outs, ins


def register_sharding(op) -> Callable:
    """PyTorch's ``torch.distributed.tensor.experimental.register_sharding`` (see the module doc).

    Example::

        @register_sharding(torch.ops.aten.mm.default)
        def mm_rule(a, b):
            return [([Replicate()], [Replicate(), Replicate()]),
                    ([Shard(0)], [Shard(0), Replicate()]),
                    ([Partial()], [Shard(1), Shard(0)])]
    """
    ops: Sequence = op if isinstance(op, (list, tuple)) else [op]
    names = []
    for o in ops:
        names.extend(n for n in _op_names(o) if n not in names)

    def wrapper(custom_sharding_fn: Callable) -> Callable:
        if not callable(custom_sharding_fn):
            raise TypeError(f"register_sharding({op!r}): decorate a function, got {custom_sharding_fn!r}")
        for n in names:
            RegisteredShardingRule(n, custom_sharding_fn)
        return custom_sharding_fn
    return wrapper


__all__ = ["register_sharding", "DTensorSpecLike"]
