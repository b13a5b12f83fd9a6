"""``DTensor.from_local(run_check=True)`` with metadata that disagrees across ranks (issue 33, item 5).

PyTorch 2.13's ``test_metadata_consistency_check``: rank 0's local tensor differs from the others'
in dtype, then in requires_grad, then in stride. With ``run_check=True`` every rank raises a
``ValueError`` (rank 0 as well as the ranks whose tensors agree with each other); with
``run_check=False`` no rank raises. No combination may hang: the check is decided from one
exchange of fixed-size metadata rows that every rank takes part in, and every rank reaches the
same verdict before any collective that depends on it (the broadcast of replicated data).
Each case runs under a timeout so that a hang fails the test instead of stalling the suite.
"""
import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import Replicate, Shard
from hyper_parallel.device_mesh import init_device_mesh as torch_style_mesh

TIMEOUT = 60  # seconds per distributed call; a hang fails here


def _local(kind, rank):
    """Rank 0 differs from the others in ``kind``; the others agree."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1
    if kind == "dtype" and rank == 0:
        t = t.to(torch.float64)
    if kind == "requires_grad":
        t = t.clone().requires_grad_(rank == 0)
    if kind == "stride" and rank == 0:
        t = t.t().contiguous().t()       # same shape (3, 4), stride (1, 3) instead of (4, 1)
    if kind == "ndim" and rank == 0:
        t = t.reshape(3, 2, 2)
    return t


def _metadata_body(kind, placements, hp_mesh):
    rank = dist.get_rank()
    n = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (n,), mesh_dim_names=("x",)) if hp_mesh else \
        torch_style_mesh("cpu", (n,), mesh_dim_names=("x",))
    pl = [Replicate()] if placements == "R" else [Shard(0)]
    out = {}
    try:
        hp.DTensor.from_local(_local(kind, rank), mesh, pl, run_check=True)
        out["check"] = None
    except ValueError as e:
        out["check"] = str(e)
    # the group still works afterwards: nobody is left inside a collective
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = t.item()
    try:
        d = hp.DTensor.from_local(_local(kind, rank), mesh, pl, run_check=False)
        out["nocheck"] = tuple(d.to_local().shape)
    except ValueError as e:  # pragma: no cover - the failure the test reports
        out["nocheck"] = f"raised: {e}"
    return out


def _assert_all_raise(outs, n, kind):
    for r, o in enumerate(outs):
        assert o["check"] is not None, (kind, r, "run_check=True did not raise")
        assert "run_check=True" in o["check"], o["check"]
        assert o["after"] == float(n), o
        assert not str(o["nocheck"]).startswith("raised"), (kind, r, o["nocheck"])


@pytest.mark.parametrize("placements", ["R", "S"])
@pytest.mark.parametrize("kind", ["dtype", "requires_grad", "stride"])
def test_metadata_consistency_check(dist_runner, kind, placements):
    outs = dist_runner.run(4, _metadata_body, kind, placements, False, timeout=TIMEOUT)
    _assert_all_raise(outs, 4, kind)
    # every rank names what differs, against the mesh's first rank
    assert all("differ from rank 0" in o["check"] for o in outs), outs


@pytest.mark.parametrize("kind", ["dtype", "requires_grad", "stride", "ndim"])
def test_metadata_consistency_check_hp_mesh(dist_runner, kind):
    """The same on HyperParallel's mesh (and a rank whose tensor has another ndim)."""
    outs = dist_runner.run(4, _metadata_body, kind, "R", True, timeout=TIMEOUT)
    _assert_all_raise(outs, 4, kind)


def _consistent_body():
    rank = dist.get_rank()
    mesh = torch_style_mesh("cpu", (dist.get_world_size(),))
    t = torch.full((3, 4), float(rank))
    d = hp.DTensor.from_local(t, mesh, [Replicate()], run_check=True)   # rank 0's data broadcast
    return d.to_local().sum().item()


def test_consistent_metadata_passes(dist_runner):
    assert dist_runner.run(4, _consistent_body, timeout=TIMEOUT) == [0.0] * 4
