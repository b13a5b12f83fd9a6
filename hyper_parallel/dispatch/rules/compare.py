"""Whole-tensor comparisons: ``equal``/``allclose`` answer for the global tensors; ``isclose`` is elementwise.

``torch.equal(a, b)`` on DTensors is one Python bool that every rank agrees on (as
in PyTorch): ``b`` is laid out like ``a`` (Partial reduced first), each rank compares
its shards and the answers are combined with a MIN all_reduce over the mesh. A
rank outside the mesh holds nothing and answers True (PyTorch's default).
"""
from __future__ import annotations

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy
from hyper_parallel.dispatch.rules.elementwise import NONLINEAR, ElementwiseOp
from hyper_parallel.distributed import collectives
import torch


def _all_true(local_ok: bool, mesh, device) -> bool:
    """AND of every mesh rank's ``local_ok`` (one small all_reduce per mesh dim of size > 1)."""
    if mesh.get_coordinate() is None:
        return True
    flag = torch.tensor([1 if local_ok else 0], dtype=torch.long, device=device)
    for d in range(mesh.ndim):
        if mesh.size(d) > 1:
            flag = collectives.all_reduce(flag, mesh.get_comm_group(d), "min")
    return bool(flag.item())


class GlobalBoolRule(DistributedOp):
    """``equal`` / ``allclose``: both inputs laid out like the first (without Partial); one global bool."""

    float_args_matter = True  # allclose's rtol/atol

    def strategy(self, call):
        if len(call.layouts) != 2:
            raise NotImplementedError(f"{call.name}: expected two DTensor arguments, got {len(call.layouts)}")
        lay = call.layouts[0].without_partial()
        mesh = call.mesh
        same_shape = call.shapes[0] == call.shapes[1]
        func = call.func

        def local_fn(left, right, *args, **kwargs):
            if not same_shape:
                if call.name == "equal":
                    return False
                raise RuntimeError(f"{call.name}: the tensors have different shapes {call.shapes[0]} and "
                                   f"{call.shapes[1]}")
            return _all_true(bool(func(left, right, *args, **kwargs)), mesh, left.device)
        ins = [lay, lay] if same_shape else list(call.layouts)
        return Strategy(ins, None, local_fn=local_fn)


def register_all():
    GlobalBoolRule("equal")
    GlobalBoolRule("allclose")
    ElementwiseOp("isclose", NONLINEAR)
