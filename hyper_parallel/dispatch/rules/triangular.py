"""``tril`` / ``triu``: computed on each rank's piece, every shard kept.

Element ``(i, j)`` of the last two dims is kept by ``tril(x, k)`` when ``j - i <= k`` (``triu``:
``>= k``). A rank holding the piece that starts at row ``r0`` and column ``c0`` sees local indices
``(i - r0, j - c0)``, so it runs the op on its piece with ``k + r0 - c0``. The offsets are those of
the rank's piece (``torch.chunk`` rules, several mesh dims on one tensor dim and uneven pieces
included). Batch dims keep their shards; the op is linear, so Partial inputs pass through.
"""
from __future__ import annotations

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt, bind_args as _bind

_NAMES = ("input", "diagonal")


class TriangularRule(DistributedOp):
    """tril / triu (see the module docstring)."""

    float_args_matter = False

    def strategy(self, call):
        v = _bind(call.args, call.kwargs, _NAMES)
        x = v.get("input")
        if not _is_dt(x):
            raise NotImplementedError(f"{call.name}: the input must be a DTensor")
        if call.dtensor_args[0] is not x:
            raise NotImplementedError(f"{call.name}: pass the input DTensor first when other DTensor arguments "
                                      "are given")
        diagonal = v.get("diagonal", 0)
        if isinstance(diagonal, bool) or not hasattr(diagonal, "__index__"):
            raise TypeError(f"{call.name}: diagonal={diagonal!r}: expected an int")
        lay, shape = call.layouts[0], call.shapes[0]
        targets = [lay] + [l.replicated() for l in call.layouts[1:]]
        coord = call.mesh.get_coordinate()
        if len(shape) < 2 or coord is None:  # (torch raises for < 2 dims; a rank off the mesh runs nothing)
            return Strategy(targets, lay)
        _, offset = lay.local_shape_and_offset(shape, coord=coord)
        shift = offset[-2] - offset[-1]
        return Strategy(targets, lay, local_fn=_shifted(call.func, shift) if shift else None)


def _shifted(func, shift):
    """``func`` (tril / triu) with the diagonal moved by ``shift``."""

    def fn(*args, **kwargs):
        v = _bind(args, kwargs, _NAMES)
        rest = {k: a for k, a in v.items() if k not in _NAMES}
        return func(v["input"], v.get("diagonal", 0) + shift, **rest)
    return fn


def register_all():
    TriangularRule("tril")
    TriangularRule("triu")


__all__ = ["TriangularRule", "register_all"]
