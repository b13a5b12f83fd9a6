"""``_StridedShard``: torch 2.13's placement, its layout math, and where FSDP produces it.

Single process: the value type (constructor, ``split_factor``, equality, hash, repr, ``is_shard``),
``_split_tensor`` / ``local_shard_size_and_offset`` and every layout's placements and local pieces
against torch's own functions. Four gloo ranks: FSDP x TP and FSDP x EP parameters built by
hyper_parallel and, in the same test on the same ranks, by torch's ``parallelize_module`` +
``fully_shard``: placements, local offsets (``compute_local_shape_and_global_offset``) and local
values agree; the parameters round-trip through ``distribute_tensor`` / ``from_local`` / ``redistribute``
/ ``full_tensor`` with their ``_StridedShard`` placements.
"""
from __future__ import annotations

import itertools
import pickle

import pytest
import torch

from hyper_parallel.dtensor.layout import Layout
from hyper_parallel.dtensor import strided_math
from hyper_parallel.placement_types import Replicate, Shard, _StridedShard, _StridedShardOffsetMode


def _torch_pl(p):
    from torch.distributed.tensor import placement_types as tp
    if isinstance(p, _StridedShard):
        return tp._StridedShard(p.dim, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return tp.Shard(p.dim)
    return tp.Replicate()


def test_value_type_matches_torch():
    from torch.distributed.tensor.placement_types import _StridedShard as TS
    a = _StridedShard(0, split_factor=2)
    t = TS(0, split_factor=2)
    assert (repr(a), str(a), a.split_factor, a.dim) == (repr(t), str(t), t.split_factor, t.dim)
    assert a.is_shard() is t.is_shard() is False and a.is_shard(0) is False
    assert a == _StridedShard(0, sf=2) and hash(a) == hash(_StridedShard(0, split_factor=2))
    assert a != Shard(0) and Shard(0) != a and a != _StridedShard(0, split_factor=3) and a != _StridedShard(1, sf=2)
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(TypeError):
        _StridedShard(0, 2)  # split_factor is keyword-only, as torch's
    with pytest.raises(TypeError, match="both split_factor and sf"):
        _StridedShard(0, split_factor=2, sf=2)
    with pytest.raises(ValueError, match="split_factor"):
        _StridedShard(0, split_factor=0)
    with pytest.raises(AttributeError):
        a.dim = 1


@pytest.mark.parametrize("size,sf,n", [(8, 2, 2), (9, 2, 4), (7, 3, 2), (5, 2, 3), (0, 2, 2), (12, 4, 3)])
def test_split_and_offsets_match_torch(size, sf, n):
    from torch.distributed.tensor.placement_types import _StridedShard as TS, Shard as TShard
    x = torch.arange(size * 2).reshape(size, 2)
    ours, pads = _StridedShard(0, split_factor=sf)._split_tensor(x, n)
    theirs, tpads = TS(0, split_factor=sf)._split_tensor(x, n)
    assert pads == tpads
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    for r in range(n):
        for mode in _StridedShardOffsetMode:
            assert _StridedShard(0, split_factor=sf).local_shard_size_and_offset(size, n, r, mode) == \
                TS(0, split_factor=sf).local_shard_size_and_offset(size, n, r, int(mode))
        assert Shard.local_shard_size_and_offset(size, n, r) == tuple(
            int(v) for v in TShard.local_shard_size_and_offset(size, n, r))


def _dim_maps(mesh_ndim):
    """Every way to shard a 1-d tensor's dim over an ordered subset of the mesh dims."""
    for k in range(mesh_ndim + 1):
        for dims in itertools.permutations(range(mesh_ndim), k):
            yield (dims,)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 3), (3, 2), (2, 2, 2)], ids=str)
def test_layout_placements_and_pieces_match_torch(mesh_shape):
    """Each layout's reported placements, run through torch's own offset function, give the layout's pieces."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as torch_fn
    base = Layout(mesh_shape)
    for dim_map in _dim_maps(len(mesh_shape)):
        lay = base.with_dim_map(dim_map)
        tpl = [_torch_pl(p) for p in lay.placements]
        n = 1
        for d in dim_map[0]:
            n *= mesh_shape[d]
        for size in (2 * n, 3 * n):  # even sizes: torch's _StridedShard is exactly the nested split
            for coord in itertools.product(*[range(s) for s in mesh_shape]):
                ours = lay.local_shape_and_offset((size,), coord=coord)
                assert ours == torch_fn((size,), mesh_shape, list(coord), tpl), (dim_map, size, coord)
                assert strided_math.torch_local_shape_and_offset((size,), mesh_shape, lay.placements, coord) == ours
        assert base.with_placements(lay.placements, 1) == lay


def test_residual_split_factor_follows_torch():
    """A split factor no mesh order explains (transformers' fused gate_up_proj): torch's rules exactly."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as torch_fn
    cases = [((2,), (_StridedShard(0, split_factor=2),)),
             ((4,), (_StridedShard(1, split_factor=2),)),
             ((2, 2), (_StridedShard(0, split_factor=3), Shard(0))),
             ((2, 2), (Shard(0), _StridedShard(0, split_factor=2))),
             ((2, 2), (_StridedShard(0, split_factor=2), _StridedShard(1, split_factor=2)))]
    for mesh_shape, pls in cases:
        lay = Layout(mesh_shape).with_placements(pls, 2)
        assert lay.is_strided and lay.placements == pls
        for shape in ((12, 8), (13, 9), (6, 4)):
            for coord in itertools.product(*[range(s) for s in mesh_shape]):
                want = torch_fn(shape, mesh_shape, list(coord), [_torch_pl(p) for p in pls])
                assert lay.local_shape_and_offset(shape, coord=coord) == want, (pls, shape, coord)


# ------------------------------------------------------------------------------- 4 gloo ranks, torch alongside
def _pieces_equal_torch():
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _pieces_equal_torch64()
    finally:
        torch.set_default_dtype(dtype)  # the worker pool is shared with later tests


def _pieces_equal_torch64():
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import distribute_tensor as torch_distribute
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as torch_offsets
    from torch.distributed.tensor.parallel import (ColwiseParallel as TCol, RowwiseParallel as TRow,
                                                   parallelize_module as torch_parallelize)

    import hyper_parallel as hp
    from hyper_parallel.swap_shims import compute_local_shape_and_global_offset as our_offsets


    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.w = nn.Parameter(torch.randn(4, 6, 5))

    def build(lib):
        mesh = (torch_mesh if lib == "torch" else hp.init_device_mesh)("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        par = torch_parallelize if lib == "torch" else hp.parallelize_module
        col, row = (TCol, TRow) if lib == "torch" else (hp.ColwiseParallel, hp.RowwiseParallel)
        fs = torch_fully_shard if lib == "torch" else hp.fully_shard
        model = par(mlp(), mesh["tp"], {"0": col(), "2": row()})
        fs(model, mesh=mesh["dp"])
        # FSDP x EP: experts Shard(0) on the ep mesh, fully_shard on the efsdp mesh (torchtitan's EP layout)
        emesh = (torch_mesh if lib == "torch" else hp.init_device_mesh)("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        experts = Experts()
        dist_fn = torch_distribute if lib == "torch" else hp.distribute_tensor
        shard = TShard(0) if lib == "torch" else hp.Shard(0)
        experts.w = nn.Parameter(dist_fn(experts.w.detach(), emesh["ep"], [shard]))
        fs(experts, mesh=emesh["efsdp"])
        return dict(model.named_parameters()) | {"experts.w": experts.w}

    theirs, ours = build("torch"), build("ours")
    seen_strided = 0
    for name, t in theirs.items():
        o = ours[name]
        assert [str(p) for p in o.placements] == [str(p) for p in t.placements], (name, o.placements, t.placements)
        seen_strided += any(isinstance(p, _StridedShard) for p in o.placements)
        ref = torch_offsets(t.shape, t.device_mesh, t.placements)
        assert our_offsets(o.shape, o.device_mesh, o.placements) == ref, name
        assert our_offsets(o.shape, o.device_mesh, t.placements) == ref, name  # torch's placement objects too
        assert tuple(o._local_tensor.shape) == tuple(t._local_tensor.shape) == ref[0], name
        assert torch.equal(o._local_tensor, t._local_tensor), name
        full = t.full_tensor().detach()
        assert torch.equal(o.full_tensor().detach(), full), name
        # the placements, given explicitly, are accepted and mean the same pieces
        dt = hp.distribute_tensor(full, o.device_mesh, o.placements)
        assert dt.placements == o.placements and torch.equal(dt._local_tensor, o._local_tensor), name
        fl = hp.DTensor.from_local(o._local_tensor.clone(), o.device_mesh, list(o.placements), shape=o.shape,
                                   stride=o.stride())
        assert torch.equal(fl.full_tensor(), full), name
        rep = fl.redistribute(placements=[hp.Replicate(), hp.Replicate()])
        assert torch.equal(rep.to_local(), full), name
        back = rep.redistribute(placements=o.placements)
        assert torch.equal(back._local_tensor, o._local_tensor) and back.placements == o.placements, name
    dist.barrier()
    return seen_strided


def test_fsdp_tp_and_ep_strided_shard_equal_torch(dist_runner):
    # 0.weight / 0.bias (colwise: TP shards dim 0, FSDP inside it), 2.weight (rowwise: dims differ), experts.w
    assert dist_runner.run(4, _pieces_equal_torch) == [3] * 4


def _differs(shape, mesh_shape):
    lay = Layout(mesh_shape).with_placements([_StridedShard(0, split_factor=mesh_shape[1]), Shard(0)], 1)
    for coord in itertools.product(*[range(s) for s in mesh_shape]):
        a = lay.local_shape_and_offset(shape, coord=coord)
        b = strided_math.torch_local_shape_and_offset(shape, mesh_shape, lay.placements, coord)
        if a[0] != b[0] or any(n and x != y for n, x, y in zip(a[0], a[1], b[1])):
            return True
    return False


def test_uneven_shapes_where_torch_reads_the_label_otherwise_raise():
    assert not _differs((8,), (2, 2)) and not _differs((6,), (2, 2))
    assert _differs((7,), (3, 2))
    lay = Layout((3, 2)).with_placements([_StridedShard(0, split_factor=2), Shard(0)], 1)
    with pytest.raises(NotImplementedError, match=r"uneven global shape \(7,\).*Pad the tensor"):
        strided_math.check_torch_pieces(lay, (7,), "distribute_tensor")
    strided_math.check_torch_pieces(lay, (12,), "distribute_tensor")
