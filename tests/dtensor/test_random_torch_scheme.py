"""torch's DTensor RNG scheme for torch programs (issue 31 item 8): the same seed gives torch's initial weights.

torch 2.13 has no DTensor RNG tracker on CPU (``_random.manual_seed`` warns and returns), so its random
ops on DTensors draw each local shard from the rank's default generator. After
``torch_manual_seed`` (what ``torch.distributed.tensor._random.manual_seed`` is under
``hyper_parallel.swap``), ``nn.init`` on hyper_parallel DTensors gives the full values torch's DTensors
get, bit for bit, for Shard/Replicate on 1-D and 2-D meshes, even and uneven shards, 2 and 4 ranks;
``hyper_parallel.manual_seed`` returns to the layout-independent stream (which differs from torch's
on shards: the check can fail).
"""
import pytest


def _cases(ws):
    import torch.distributed.tensor as tdt
    import hyper_parallel as hp
    pairs = [("Shard0", [tdt.Shard(0)], [hp.Shard(0)]), ("Shard1", [tdt.Shard(1)], [hp.Shard(1)]),
             ("Replicate", [tdt.Replicate()], [hp.Replicate()])]
    meshes = [((ws,), pairs)]
    if ws == 4:
        meshes.append(((2, 2), [("S0S1", [tdt.Shard(0), tdt.Shard(1)], [hp.Shard(0), hp.Shard(1)]),
                                ("RS0", [tdt.Replicate(), tdt.Shard(0)], [hp.Replicate(), hp.Shard(0)]),
                                ("S0S0", [tdt.Shard(0), tdt.Shard(0)], [hp.Shard(0), hp.Shard(0)])]))
    return meshes


def _init(t):
    """What torchtitan's init_weights does to parameters, and a few more random ops."""
    import torch.nn as nn
    nn.init.trunc_normal_(t[0], mean=0.0, std=0.02)
    nn.init.normal_(t[1], std=0.5)
    nn.init.uniform_(t[2], -0.3, 0.3)
    nn.init.kaiming_uniform_(t[3])
    t[4].bernoulli_(0.3)
    return t


def _body(seed):
    import warnings
    import torch
    import torch.distributed.tensor as tdt
    import torch.distributed.tensor._random as torch_random
    from torch.distributed.device_mesh import init_device_mesh
    import hyper_parallel as hp
    from hyper_parallel import swap_shims
    from hyper_parallel.dtensor import random as hp_random
    import torch.distributed as dist
    shapes = [(10, 6), (8, 12), (7, 5), (12, 4), (9, 3)]     # uneven shards included
    done = []
    try:
        for mshape, pairs in _cases(dist.get_world_size()):
            mesh = init_device_mesh("cpu", mshape)
            for name, tpl, hpl in pairs:
                torch.manual_seed(seed)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch_random.manual_seed(seed, mesh)
                ref = _init([tdt.distribute_tensor(torch.zeros(s), mesh, tpl) for s in shapes])
                ref = [r.full_tensor() for r in ref]
                torch.manual_seed(seed)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    swap_shims.manual_seed(seed, mesh)           # the swapped program's call
                got = _init([hp.distribute_tensor(torch.zeros(s), mesh, hpl) for s in shapes])
                for i, (g, r) in enumerate(zip(got, ref)):
                    assert torch.equal(g.full_tensor(), r), (mshape, name, i)
                # HyperParallel's entry point: the layout-independent stream again (not torch's shards)
                hp.manual_seed(seed)
                torch.manual_seed(seed)
                hp_vals = _init([hp.distribute_tensor(torch.zeros(s), mesh, hpl) for s in shapes])
                if "S" in name:
                    assert not torch.equal(hp_vals[1].full_tensor(), ref[1]), (mshape, name)
                done.append((mshape, name))
    finally:
        hp_random.set_scheme("hyper_parallel")
    return len(done)


@pytest.mark.parametrize("ws", [2, 4])
def test_torch_scheme_initial_values_equal_torch(dist_runner, ws):
    assert dist_runner.run(ws, _body, 1234, timeout=300) == [3 if ws == 2 else 6] * ws


def test_scheme_arguments():
    from hyper_parallel.dtensor import random as hp_random
    with pytest.raises(ValueError, match="scheme must be one of"):
        hp_random.set_scheme("philox")
    with pytest.raises(TypeError, match="seed must be an int"):
        hp_random.torch_manual_seed("7", None)
    assert not hp_random.device_has_rng("cpu")
