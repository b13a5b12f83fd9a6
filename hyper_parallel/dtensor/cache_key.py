"""The interned (layout, global shape) token of a DTensor: the dispatcher's cache-key part."""
from __future__ import annotations


class Spec:
    """The interned (layout, global shape) pair of a DTensor: the dispatcher's cache-key token.

    One object per distinct pair (see :func:`spec_of`), hashed and compared by
    identity, which the interpreter does in C: a key built from specs costs no
    Python-level ``Layout.__hash__`` call, and a spec never equals a scalar
    argument that shares the key.
    """

    __slots__ = ("layout", "shape")

    def __init__(self, layout, shape):
        self.layout, self.shape = layout, shape

    def __repr__(self):
        return f"Spec({self.layout}, {tuple(self.shape)})"


_SPECS: dict = {}
_SPECS_MAX = 65536


def spec_of(layout, shape) -> Spec:
    """The interned :class:`Spec` of ``(layout, shape)``.

    The table is bounded: when full it starts afresh, after which equal pairs may
    get a new token (a dispatcher cache miss, never a wrong hit: a token is never
    reused for another pair).
    """
    key = (layout, shape)
    s = _SPECS.get(key)
    if s is None:
        if len(_SPECS) >= _SPECS_MAX:
            _SPECS.clear()
        s = _SPECS[key] = Spec(layout, shape)
    return s


__all__ = ["Spec", "spec_of"]
