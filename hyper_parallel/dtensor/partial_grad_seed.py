"""``dt.backward(g)`` with a ``Partial(sum)`` gradient that reaches ``from_local(grad_placements=[Partial()])``.

PyTorch keeps such a gradient Partial all the way: ``from_local(x, [Replicate()],
grad_placements=[Partial()])``, ``(dt * 2).backward(Partial ones)`` leaves ``x.grad = 2 * ones``
on every rank with no collective. Our gradient convention would reduce the Partial seed first
(an all_reduce). Here, when every gradient path from ``dt`` runs through plain local ops
into such ``from_local`` nodes only (no leaf, no collective on the way; checked by walking
the autograd graph), the pieces are fed in unreduced and those nodes pass them on: by
linearity each rank's result is its piece of the true gradient, which is what
``grad_placements=[Partial()]`` asks for. Any other graph takes the ordinary path.
"""
from __future__ import annotations

from hyper_parallel.dtensor.redistribute import GradRedistribute
from hyper_parallel.distributed import partial_grad_graph


def seed_partial_pieces(dtensor, gradient, want, retain_graph) -> bool:
    """Run ``dtensor``'s backward with ``gradient``'s pieces if that is exact (see the module doc); True if run."""
    gl = gradient._layout
    if gradient._mesh != dtensor._mesh or dtensor._mesh._coord is None:
        return False
    if gl.without_partial() != want or any(op not in (None, "sum") for op in gl.partial):
        return False
    root = dtensor._local_tensor.grad_fn
    if root is None:
        return False
    mesh = dtensor._mesh

    def is_target(node):
        if getattr(node, "_forward_cls", None) is not GradRedistribute:
            return False
        plan = getattr(node, "plan", None)
        return plan is not None and plan.dst == gl and plan.src == want and getattr(node, "mesh", None) == mesh

    targets = partial_grad_graph.piece_targets(root, is_target)
    if not targets:
        return False
    for node in targets:
        node.hp_pass_pieces = True
    try:
        dtensor._local_tensor.backward(gradient._local_tensor, retain_graph=retain_graph)
    finally:
        for node in targets:
            node.hp_pass_pieces = False
    return True
