"""``clone()`` of a Partial DTensor is Replicate on a torch mesh (torch 2.13: checked by running torch's DTensor
on 2 ranks; ``contiguous()`` keeps Partial(sum)), Partial on a HyperParallel mesh. torchtitan's full_dtensor
backend logs ``loss.detach().clone().to_local()`` summed over the dp ranks, so its reported loss depends on it."""
from __future__ import annotations

import pytest


def _body(op, hp_mesh):
    import torch
    import torch.distributed as dist

    import hyper_parallel as hp
    from hyper_parallel import Partial
    rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = hp.init_device_mesh("cpu", (2,)) if hp_mesh else init_device_mesh("cpu", (2,))
    out = []
    for shape in [(), (3,)]:
        x = torch.full(shape, float(rank + 1), dtype=torch.float64, requires_grad=True)
        d = hp.DTensor.from_local(x, mesh, [Partial(op)])
        c = d.clone()
        out.append((str(c.placements), c.to_local().tolist(), str(d.contiguous().placements), c.full_tensor().tolist()))
    return out


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_clone_of_partial_is_replicate_on_torch_meshes(dist_runner, op):
    value = {"sum": 3.0, "avg": 1.5, "max": 2.0}[op]
    out = dist_runner.run(2, _body, op, False)
    want = [("(Replicate(),)", value, value), ("(Replicate(),)", [value] * 3, [value] * 3)]
    assert [[(o[0], o[1], o[3]) for o in rank] for rank in out] == [want] * 2
    if op == "sum":
        assert {o[2] for rank in out for o in rank} == {"(Partial(sum),)"}


def test_clone_of_partial_stays_partial_on_hp_meshes(dist_runner):
    out = dist_runner.run(2, _body, "sum", True)
    assert [o[0] for o in out[0]] == ["(Partial(sum),)"] * 2
    assert out[0][0][1] == 1.0 and out[1][0][1] == 2.0
