"""Shrunk failures of the property-based sweep (tests/dispatch/test_property_sweep.py) as ordinary tests.

Each case is the minimal example the sweep reported, checked by the sweep's own per-rank check
(values and gradients against one process, float64, 1e-10).
"""
import pytest
import torch

import hyper_parallel as hp
from hyper_parallel import Partial
from tests.harness.sweep_cases import Case, check_cases

# gather with a plain (non-DTensor) index tensor: docs/ops.md says indexing ops accept integer index
# tensors, and index_select did, but GatherRule raised "gather: input and index must both be DTensors".
# Fixed in dispatch/rules/gather_ops.py: a plain index counts as replicated (a sharded gather dim is
# still looked up locally, giving Partial(sum)).
GATHER_PLAIN_INDEX = [
    Case(op="indexing", args=("gather", 1), mesh=(4,), inputs=(((2, 6, 3), "f", ("obj", ("S0",))),
                                                               ((2, 7, 2), ("i", 6), None))),
    Case(op="indexing", args=("gather", 0), mesh=(2, 2),
         inputs=(((2, 2, 5), "f", ("alias", (("dp", "tp"), "None", "None"))), ((2, 2, 1), ("i", 2), None))),
    Case(op="indexing", args=("gather", 2), mesh=(2, 2),
         inputs=(((2, 2, 5), "f", ("obj", ("S2", "P:sum"))), ((2, 1, 1), ("i", 5), None))),
    Case(op="indexing", args=("gather", 0), mesh=(4,), inputs=(((3,), "f", ("obj", ("S0",))),
                                                               ((5,), ("i", 3), None))),
]

# F.normalize had no rule ("hyper_parallel has no sharding rule for op 'normalize'"); now decomposed
# into norm / clamp_min / expand_as / div as torch computes it (dispatch/rules/nn_ops.py).
NORMALIZE = [
    Case(op="norm", args=("normalize", 0), mesh=(4,), inputs=(((1,), "f", ("alias", ("tp",))),)),
    Case(op="norm", args=("normalize", 1), mesh=(4,), inputs=(((7, 5), "f", ("obj", ("P:min",))),)),
    Case(op="norm", args=("normalize", -3), mesh=(2, 2), inputs=(((7, 6, 7), "f", ("obj", ("S2", "S0"))),),
         loss="dtensor"),
    Case(op="norm", args=("normalize", -1), mesh=(2, 2),
         inputs=(((6, 2, 3), "f", ("alias", ("tp", "None", "dp"))),)),
]

# scaled_dot_product_attention with a batch (or head) dim of size 1 in every operand, sharded: the rule
# took size 1 for a broadcast dim, gathered the query there but still declared the output sharded, so
# ranks with an empty piece returned a whole batch and the next all_gather failed on some ranks
# ("Trying to create tensor with negative dimension") while the others waited. Fixed in
# dispatch/rules/nn_ops.py (SDPARule: size 1 is a broadcast only against a larger operand).
SDPA_SIZE1 = [
    Case(op="norm", args=("sdpa", False), mesh=(2, 2),
         inputs=(((1, 1, 4, 1), "f", ("obj", ("S0", "S0"))), ((1, 1, 1, 1), "f", ("obj", ("S3", "S3"))),
                 ((1, 1, 1, 4), "f", ("alias", ("tp", "dp", "None", "None")))), seed=65535),
    Case(op="norm", args=("sdpa", False), mesh=(2, 2),
         inputs=(((1, 1, 4, 1), "f", ("obj", ("S0", "R"))), ((1, 1, 1, 1), "f", ("obj", ("R", "R"))),
                 ((1, 1, 1, 4), "f", ("obj", ("R", "R"))))),
    Case(op="norm", args=("sdpa", True), mesh=(4,),
         inputs=(((2, 1, 3, 2), "f", ("obj", ("S1",))), ((2, 1, 3, 2), "f", ("obj", ("S1",))),
                 ((2, 1, 3, 2), "f", ("alias", ("None", "tp", "None", "None")))), loss="dtensor"),
]


@pytest.mark.parametrize("cases", [GATHER_PLAIN_INDEX, NORMALIZE, SDPA_SIZE1],
                         ids=["gather_plain_index", "normalize", "sdpa_size1_batch"])
def test_shrunk_cases(dist_runner, cases):
    assert dist_runner.run(4, check_cases, cases) == [len(cases)] * 4


def _partial_leaf_grad_body(op, use):
    """A leaf DTensor with Partial(op) placements: its .grad is the full gradient on every rank, Replicate."""
    mesh = hp.init_device_mesh("cpu", (2,))
    r = torch.distributed.get_rank()
    full = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    other = (torch.arange(4) % 2 != r) * 1.0
    piece = {"avg": full + (r - 0.5), "max": full - other, "min": full + other}[op]
    d = hp.DTensor.from_local(piece, mesh, [Partial(op)], shape=(4,), stride=(1,)).requires_grad_()
    w = torch.tensor([1.0, 10.0, 100.0, 1000.0], dtype=torch.float64)
    value = {"full_tensor": lambda: d.full_tensor(),
             "via_shard": lambda: d.redistribute(mesh, [hp.Shard(0)]).full_tensor(),
             "times_two": lambda: (d * 2).full_tensor() / 2}[use]()
    assert value.tolist() == full.tolist()
    (value * w).sum().backward()
    return str(d.grad.placements), d.grad.to_local().tolist(), d.grad.full_tensor().tolist()


# A leaf DTensor with Partial(avg/max/min) placements: its .grad held each rank's piece gradient (W/k, or
# W masked to the winning rank) labelled Replicate, so ranks disagreed on a 'Replicate' tensor. Now as
# PyTorch 2.13 (checked by running torch's DTensor on the same 2 ranks): the full gradient W, Replicate
# (dtensor/grad_state.py: is_partial_leaf; the redistribution of such a leaf reads its gradient as
# Replicate). Pieces entering through from_local of a non-leaf tensor keep the reduction's adjoint.
@pytest.mark.parametrize("use", ["full_tensor", "via_shard", "times_two"])
@pytest.mark.parametrize("op", ["avg", "max", "min"])
def test_partial_leaf_dtensor_grad_is_the_full_gradient(dist_runner, op, use):
    w = [1.0, 10.0, 100.0, 1000.0]
    out = dist_runner.run(2, _partial_leaf_grad_body, op, use)
    assert out == [("(Replicate(),)", w, w)] * 2, (op, use, out)
