"""Autograd-graph walk for seeding a backward pass with a Partial gradient's pieces.

Backpropagation is linear in the seed gradient, and the local graph of plain tensor ops
is the same linear map on every rank of a replicated mesh dim, so the pieces of a
``Partial(sum)`` gradient can flow through such a graph unreduced: the per-rank results
still sum to the true gradient. That is only valid where the gradients end up in nodes
that accept pieces (a ``from_local(..., grad_placements=[Partial()])``); ``piece_targets``
checks it.
"""
from __future__ import annotations

_LIMIT = 20000  # nodes walked at most; larger graphs take the ordinary (reducing) path


def piece_targets(root, is_target):
    """The nodes ``is_target`` accepts that every gradient path from ``root`` ends in, or None.

    None (unsafe) if a path reaches a leaf (``AccumulateGrad``), one of the library's own
    autograd Functions (collectives, redistributions: not linear per rank), or the graph is
    larger than the walk's limit; also None if no target is reached.
    """
    seen, stack, targets = set(), [root], []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > _LIMIT:
            return None
        if is_target(node):
            targets.append(node)
            continue
        if type(node).__name__ == "AccumulateGrad":
            return None
        fwd = getattr(node, "_forward_cls", None)
        if fwd is not None and getattr(fwd, "__module__", "").startswith("hyper_parallel"):
            return None
        for nxt, _ in node.next_functions:
            if nxt is not None:
                stack.append(nxt)
    return targets or None
