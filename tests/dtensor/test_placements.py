"""Placement value types: immutability, equality, hashing, repr, predicates (no processes)."""
import copy
import pickle

import pytest

import hyper_parallel as hp
from hyper_parallel import Partial, Placement, Replicate, Shard


ALL = [Shard(0), Shard(1), Shard(-1), Replicate(), Partial(), Partial("avg"), Partial("max"),
       Partial("min"), Partial("prod")]


@pytest.mark.parametrize("p", ALL, ids=str)
def test_immutable(p):
    with pytest.raises(AttributeError, match="immutable"):
        p.dim = 3
    with pytest.raises(AttributeError):
        p.reduce_op = "max"
    with pytest.raises(AttributeError):
        p.anything_new = 1


def test_shard_dim_is_frozen():
    s = Shard(1)
    with pytest.raises(AttributeError, match="Shard is immutable"):
        s.dim = 0
    assert s.dim == 1


def test_equality_by_value():
    assert Shard(0) == Shard(0)
    assert Shard(0) != Shard(1)
    assert Replicate() == Replicate()
    assert Partial() == Partial("sum")
    assert Partial("sum") != Partial("avg")
    assert Shard(0) != Replicate()
    assert Replicate() != Partial()
    assert Partial() != Shard(0)
    # not equal to foreign objects (no exception)
    assert Shard(0) != 0
    assert Replicate() != "R"
    assert Partial() != None  # noqa: E711


def test_hash_consistent_and_usable_in_sets():
    assert hash(Shard(2)) == hash(Shard(2))
    assert hash(Partial("max")) == hash(Partial("max"))
    assert hash(Replicate()) == hash(Replicate())
    s = {Shard(0), Shard(0), Replicate(), Replicate(), Partial(), Partial("sum"), Partial("avg")}
    assert s == {Shard(0), Replicate(), Partial(), Partial("avg")}
    assert len(s) == 4
    d = {(Shard(0), Replicate()): "a"}
    assert d[(Shard(0), Replicate())] == "a"


def test_repr_and_str():
    assert repr(Shard(1)) == "Shard(dim=1)"
    assert repr(Replicate()) == "Replicate()"
    assert repr(Partial()) == "Partial(sum)"
    assert repr(Partial("avg")) == "Partial(avg)"
    assert str(Shard(0)) == "S(0)"
    assert str(Replicate()) == "R"
    assert str(Partial()) == "P(sum)"  # as PyTorch
    assert str(Partial("max")) == "P(max)"


def test_is_shard_with_dim():
    s = Shard(1)
    assert s.is_shard() and s.is_shard(1)
    assert not s.is_shard(0)
    assert not s.is_replicate() and not s.is_partial()
    r = Replicate()
    assert r.is_replicate() and not r.is_shard() and not r.is_shard(0) and not r.is_partial()
    p = Partial("min")
    assert p.is_partial() and not p.is_shard() and not p.is_shard(0) and not p.is_replicate()
    assert p.reduce_op == "min"


def test_all_are_placements():
    for p in ALL:
        assert isinstance(p, Placement)
    assert hp.Shard is Shard and hp.Replicate is Replicate and hp.Partial is Partial


@pytest.mark.parametrize("p", ALL, ids=str)
def test_pickle_and_copy_roundtrip(p):
    q = pickle.loads(pickle.dumps(p))
    assert q == p and hash(q) == hash(p) and type(q) is type(p)
    assert copy.copy(p) is p
    assert copy.deepcopy(p) is p


def test_constructor_validation():
    with pytest.raises(TypeError, match="dim must be an int"):
        Shard("0")
    with pytest.raises(TypeError, match="dim must be an int"):
        Shard(True)
    with pytest.raises(TypeError, match="dim must be an int"):
        Shard(1.0)
    with pytest.raises(ValueError, match="'mean'"):
        Partial("mean")


def test_shard_split_tensor_matches_torch():
    """``Shard._split_tensor`` (used by PyTorch's tests and user code) gives torch's pieces and pad sizes."""
    import torch
    from torch.distributed.tensor import Shard as TorchShard
    for shape, dim in (((5, 2), 0), ((3, 7), 1), ((1, 4), 0), ((0, 3), 0)):
        t = torch.arange(float(shape[0] * shape[1])).reshape(shape)
        for n in (1, 2, 3, 4, 8):
            for pad in (True, False):
                ours, our_pads = Shard(dim)._split_tensor(t, n, with_padding=pad, contiguous=True)
                theirs, their_pads = TorchShard(dim)._split_tensor(t, n, with_padding=pad, contiguous=True)
                assert our_pads == their_pads and len(ours) == len(theirs) == n
                for a, b in zip(ours, theirs):
                    assert a.shape == b.shape and torch.equal(a, b)
