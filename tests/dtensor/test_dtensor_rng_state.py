"""The DTensor random stream's position: ``get_rng_state`` / ``set_rng_state`` (issue 33, item 1).

A checkpoint stores ``{"seed", "offset"}`` (examples/llama/checkpoint.py, ``dtensor_rng``); restoring
it continues the stream exactly where the uninterrupted program would have drawn next, on every
rank and for every layout (2 gloo ranks, Shard(0), Shard(1) and Replicate draws), and equal to the
same draws in one process.
"""
import pytest
import torch

import hyper_parallel as hp
from hyper_parallel import Replicate, Shard
from hyper_parallel.core.dtensor import random as dt_random
from hyper_parallel.core.dtensor.random import get_rng_state, random_local, set_rng_state
from tests.harness.parity import _meshes

DT = torch.float64


def test_state_round_trip_continues_the_stream():
    hp.manual_seed(11)
    random_local("rand", (5, 3), (5, 3), (0, 0), DT)
    st = get_rng_state()
    assert st == {"seed": 11, "offset": 1}
    a = random_local("rand", (5, 3), (5, 3), (0, 0), DT)
    b = random_local("randn", (4,), (4,), (0,), DT)
    hp.manual_seed(99)  # anything in between
    random_local("rand", (2,), (2,), (0,), DT)
    set_rng_state(st)
    assert torch.equal(random_local("rand", (5, 3), (5, 3), (0, 0), DT), a)
    assert torch.equal(random_local("randn", (4,), (4,), (0,), DT), b)
    assert get_rng_state() == {"seed": 11, "offset": 3}
    # a seed too large for an int64 (torch.initial_seed() can be) round-trips too
    set_rng_state({"seed": 2**64 - 5, "offset": 7})
    assert get_rng_state() == {"seed": 2**64 - 5, "offset": 7}


def test_unset_seed_round_trips():
    saved = dict(dt_random._state)
    try:
        dt_random._state.update(seed=None, counter=0)
        st = get_rng_state()
        assert st == {"seed": None, "offset": 0}
        hp.manual_seed(3)
        set_rng_state(st)
        assert get_rng_state() == {"seed": None, "offset": 0}
    finally:
        dt_random._state.update(saved)


@pytest.mark.parametrize("bad, err, match", [
    ({"seed": 1}, ValueError, "keys 'seed' and 'offset'"),
    ((1, 2), ValueError, "keys 'seed' and 'offset'"),
    ({"seed": "1", "offset": 0}, TypeError, "seed must be an int or None, got '1'"),
    ({"seed": True, "offset": 0}, TypeError, "seed must be an int or None"),
    ({"seed": 1, "offset": -1}, ValueError, "offset must be an int >= 0, got -1"),
    ({"seed": 1, "offset": 1.0}, ValueError, "offset must be an int >= 0, got 1.0"),
])
def test_bad_state_names_the_problem(bad, err, match):
    before = get_rng_state()
    with pytest.raises(err, match=match):
        set_rng_state(bad)
    assert get_rng_state() == before


def _restore_body():
    """Sharded draws after ``set_rng_state`` equal the uninterrupted program's, and one process's."""
    mesh = _meshes()[0]
    hp.manual_seed(7)
    hp.rand(6, 4, device_mesh=mesh, placements=[Shard(0)])
    st = get_rng_state()
    later = [hp.rand(6, 4, device_mesh=mesh, placements=[p]).full_tensor() for p in (Shard(0), Shard(1))]
    hp.manual_seed(123)
    hp.rand(6, 4, device_mesh=mesh, placements=[Shard(1)])
    set_rng_state(st)
    again = [hp.rand(6, 4, device_mesh=mesh, placements=[p]).full_tensor() for p in (Shard(1), Shard(0))]
    assert torch.equal(later[0], again[0]) and torch.equal(later[1], again[1])
    set_rng_state(st)  # one process, the same stream position
    one = random_local("rand", (6, 4), (6, 4), (0, 0), torch.float32)
    assert torch.equal(one, later[0])
    assert not torch.equal(later[0], later[1])  # consecutive calls differ: the offset matters
    return get_rng_state()


def test_restored_stream_continues_on_every_rank(dist_runner):
    states = dist_runner.run(2, _restore_body)
    assert states[0] == states[1] == {"seed": 7, "offset": 2}
