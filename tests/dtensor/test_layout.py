"""Layout math (no processes): alias <-> placement conversion, tensor_map, local shapes/offsets.

Ground truth for local pieces is ``torch.chunk`` applied sequentially (outer mesh
dim first) to an actual ``torch.arange`` tensor; the piece's global offset is
read back from the values it holds.
"""
import itertools

import pytest
import torch

from hyper_parallel import Layout, Partial, Replicate, Shard
from hyper_parallel.placement_types import _StridedShard
from hyper_parallel.core.dtensor.layout import chunk_size_and_offset, chunk_sizes, coordinate_of

NAMES = {1: ("x",), 2: ("dp", "tp"), 3: ("pp", "dp", "tp")}
MESHES = [(4,), (2, 2), (2, 2, 2), (1, 4), (4, 1), (3,), (2, 3)]
SHAPES = [(3, 5), (8, 6), (1, 7), (2, 3), (7, 9), (4, 4), (5, 1), (0, 4)]


def _base(mesh_shape):
    return Layout(mesh_shape, NAMES.get(len(mesh_shape)) if mesh_shape not in ((2, 3),) else ("a", "b"))


def _all_dim_maps(n_mesh, ndim):
    """Every assignment of mesh dims to tensor dims, with every order inside a tensor dim."""
    for assign in itertools.product([None] + list(range(ndim)), repeat=n_mesh):
        groups = [[d for d in range(n_mesh) if assign[d] == t] for t in range(ndim)]
        for perms in itertools.product(*[list(itertools.permutations(g)) for g in groups]):
            yield tuple(tuple(p) for p in perms)


def _ground_truth(global_shape, mesh_shape, dim_map, coord):
    """(local shape, offset or None per dim when empty) by torch.chunk on an arange."""
    n = 1
    for s in global_shape:
        n *= s
    x = torch.arange(n).reshape(global_shape)
    for t, dims in enumerate(dim_map):
        for d in dims:
            chunks = torch.chunk(x, mesh_shape[d], dim=t) if x.shape[t] else ()
            if coord[d] < len(chunks):
                x = chunks[coord[d]]
            else:
                shp = list(x.shape)
                shp[t] = 0
                x = x.new_empty(shp)
    shape = tuple(x.shape)
    if x.numel():
        first = x.reshape(-1)[0].item()
        offset = tuple(int(v) for v in torch.unravel_index(torch.tensor(first), tuple(global_shape)))
    else:
        offset = None
    return shape, offset, x


# ------------------------------------------------------------------ chunk helpers

@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 6, 7, 8, 13])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_chunk_sizes_match_torch_chunk(n, k):
    pieces = [c.numel() for c in torch.chunk(torch.arange(n), k)] if n else []
    pieces += [0] * (k - len(pieces))
    assert chunk_sizes(n, k) == tuple(pieces)
    start = 0
    for i, s in enumerate(pieces):
        size, off = chunk_size_and_offset(n, k, i)
        assert size == s
        if s:
            assert off == start
        start += s


def test_chunk_sizes_examples():
    assert chunk_sizes(3, 4) == (1, 1, 1, 0)
    assert chunk_sizes(5, 4) == (2, 2, 1, 0)
    assert chunk_sizes(6, 4) == (2, 2, 2, 0)      # torch.chunk gives only 3 pieces
    assert chunk_sizes(7, 4) == (2, 2, 2, 1)
    assert chunk_sizes(8, 4) == (2, 2, 2, 2)
    assert chunk_sizes(1, 4) == (1, 0, 0, 0)


def test_coordinate_of_row_major():
    assert [coordinate_of(i, (2, 2)) for i in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert coordinate_of(5, (2, 2, 2)) == (1, 0, 1)
    assert coordinate_of(3, (1, 4)) == (0, 3)
    assert coordinate_of(3, (4, 1)) == (3, 0)


# ------------------------------------------------------------------ local shape / offset tables

@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("gshape", SHAPES, ids=str)
def test_local_shape_and_offset_vs_torch_chunk(mesh_shape, gshape):
    base = _base(mesh_shape)
    n_ranks = 1
    for s in mesh_shape:
        n_ranks *= s
    checked = 0
    for dim_map in _all_dim_maps(len(mesh_shape), len(gshape)):
        lay = base.with_dim_map(dim_map)
        full = torch.arange(max(1, torch.Size(gshape).numel()))[: torch.Size(gshape).numel()].reshape(gshape)
        for rank in range(n_ranks):
            coord = coordinate_of(rank, mesh_shape)
            want_shape, want_off, piece = _ground_truth(gshape, mesh_shape, dim_map, coord)
            shape, off = lay.local_shape_and_offset(gshape, rank)
            ctx = f"mesh={mesh_shape} shape={gshape} dim_map={dim_map} alias={lay.alias_placements} rank={rank}"
            assert shape == want_shape, ctx
            assert lay.local_shape(gshape, coord=coord) == want_shape, ctx
            if want_off is not None:
                assert off == want_off, ctx
                block = full
                for t, (o, s) in enumerate(zip(off, shape)):
                    block = block.narrow(t, o, s)
                assert torch.equal(block, piece), ctx
            else:
                for o, n in zip(off, gshape):
                    assert 0 <= o <= n, ctx
            checked += 1
    assert checked > 0


def _table(lay, gshape, n_ranks):
    return [lay.local_shape_and_offset(gshape, r) for r in range(n_ranks)]


def test_explicit_table_3x5_on_4():
    base = Layout((4,), ("x",))
    assert _table(base("x", "None"), (3, 5), 4) == [((1, 5), (0, 0)), ((1, 5), (1, 0)), ((1, 5), (2, 0)),
                                                   ((0, 5), (3, 0))]
    assert _table(base("None", "x"), (3, 5), 4) == [((3, 2), (0, 0)), ((3, 2), (0, 2)), ((3, 1), (0, 4)),
                                                   ((3, 0), (0, 5))]


def test_explicit_table_multi_axis_both_orders():
    base = Layout((2, 2), ("dp", "tp"))
    # 7 rows over dp (outer) then tp: dp halves are 4|3, then tp splits 4 -> 2|2, 3 -> 2|1
    lay = base(("dp", "tp"), "None")
    assert [s for s, _ in _table(lay, (7, 3), 4)] == [(2, 3), (2, 3), (2, 3), (1, 3)]
    assert [o[0] for _, o in _table(lay, (7, 3), 4)] == [0, 2, 4, 6]
    # tp outer: rank (dp=i, tp=j) holds block j*2+i
    lay = base(("tp", "dp"), "None")
    assert [o[0] for _, o in _table(lay, (8, 3), 4)] == [0, 4, 2, 6]
    assert [s[0] for s, _ in _table(lay, (7, 3), 4)] == [2, 2, 2, 1]
    assert [o[0] for _, o in _table(lay, (7, 3), 4)] == [0, 4, 2, 6]


def test_explicit_table_dim_smaller_than_mesh_2x2x2():
    base = Layout((2, 2, 2), ("pp", "dp", "tp"))
    lay = base(("pp", "dp", "tp"), "None")
    shapes = [s for s, _ in _table(lay, (3, 2), 8)]
    # 3 -> 2|1 over pp; 2 -> 1|1 and 1 -> 1|0 over dp; then 1 -> 1|0 over tp
    assert shapes == [(1, 2), (0, 2), (1, 2), (0, 2), (1, 2), (0, 2), (0, 2), (0, 2)]


def test_mesh_with_size_one_dims():
    for mesh_shape, names in [((1, 4), ("a", "b")), ((4, 1), ("a", "b"))]:
        base = Layout(mesh_shape, names)
        big = "b" if mesh_shape == (1, 4) else "a"
        small = "a" if big == "b" else "b"
        lay = base(big, small)
        assert [s for s, _ in _table(lay, (6, 3), 4)] == [(2, 3), (2, 3), (2, 3), (0, 3)]
        lay = base((small, big), "None")
        assert [s for s, _ in _table(lay, (5, 3), 4)] == [(2, 3), (2, 3), (1, 3), (0, 3)]


def test_global_shape_even():
    base = Layout((2, 2), ("dp", "tp"))
    assert base(("dp", "tp"), "None").global_shape((2, 3)) == (8, 3)
    assert base("tp", "dp").global_shape((2, 3)) == (4, 6)
    assert base("None", "None").global_shape((2, 3)) == (2, 3)
    lay = base.with_placements([Partial(), Shard(1)], 2)
    assert lay.global_shape((2, 3)) == (2, 6)
    with pytest.raises(ValueError, match="local shape"):
        base("dp", "None").global_shape((2,))


def test_is_even():
    base = Layout((2, 2), ("dp", "tp"))
    assert base(("dp", "tp"), "None").is_even((8, 3))
    assert not base(("dp", "tp"), "None").is_even((6, 3))
    assert not base("dp", "tp").is_even((4, 3))


# ------------------------------------------------------------------ alias <-> placements

def test_alias_to_placements_1d():
    base = Layout((4,), ("x",))
    assert base("x", "None").placements == (Shard(0),)
    assert base("None", "x").placements == (Shard(1),)
    assert base("None", "None").placements == (Replicate(),)


def test_alias_to_placements_2d():
    base = Layout((2, 2), ("dp", "tp"))
    assert base("dp", "None").placements == (Shard(0), Replicate())
    assert base("tp", "None").placements == (Replicate(), Shard(0))
    assert base("tp", "dp").placements == (Shard(1), Shard(0))
    assert base(("dp", "tp"), "None").placements == (Shard(0), Shard(0))
    # tp outside dp: PyTorch's _StridedShard on dp (FSDP x TP's parameters)
    assert base(("tp", "dp"), "None").placements == (_StridedShard(0, split_factor=2), Shard(0))
    assert base("None", ("tp", "dp")).placements == (_StridedShard(1, split_factor=2), Shard(1))


def test_multi_axis_orders_differ():
    base = Layout((2, 2), ("dp", "tp"))
    a = base(("dp", "tp"), "None")
    b = base(("tp", "dp"), "None")
    assert a != b
    assert a.is_mesh_ordered and not b.is_mesh_ordered
    assert a.dim_map == ((0, 1), ()) and b.dim_map == ((1, 0), ())
    assert "alias=" in repr(b) and "alias=" not in repr(a)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (2, 2, 2), (1, 4), (4, 1)], ids=str)
def test_roundtrips_exhaustive(mesh_shape):
    base = _base(mesh_shape)
    for dim_map in _all_dim_maps(len(mesh_shape), 2):
        lay = base.with_dim_map(dim_map)
        aliases = lay.alias_placements
        # aliases -> layout -> aliases
        again = base(*aliases)
        assert again == lay, (dim_map, aliases)
        assert again.alias_placements == aliases
        # placements (_StridedShard for out-of-order shards) -> layout: exact, up to the order
        # of size-1 mesh dims (which hold the same data in any order)
        from_pl = base.with_placements(lay.placements, 2)
        assert from_pl.placements == lay.placements, (dim_map, lay.placements)
        if lay.is_mesh_ordered or 1 not in mesh_shape:
            assert from_pl == lay, (dim_map, lay.placements)
        assert base(*from_pl.alias_placements) == from_pl


@pytest.mark.parametrize("placements,aliases", [
    ((Shard(0), Replicate()), ("dp", "None")),
    ((Replicate(), Shard(0)), ("tp", "None")),
    ((Shard(1), Shard(0)), ("tp", "dp")),
    ((Shard(0), Shard(0)), (("dp", "tp"), "None")),
    ((Shard(1), Shard(1)), ("None", ("dp", "tp"))),
    ((Replicate(), Replicate()), ("None", "None")),
    ((Shard(-1), Shard(-2)), ("tp", "dp")),
])
def test_placements_to_alias(placements, aliases):
    base = Layout((2, 2), ("dp", "tp"))
    lay = base.with_placements(placements, 2)
    assert lay.alias_placements == aliases
    assert base(*aliases) == lay


def test_partial_layout_keeps_partial():
    base = Layout((2, 2), ("dp", "tp"))
    lay = base.with_placements([Partial("max"), Shard(1)], 2)
    assert lay.placements == (Partial("max"), Shard(1))
    assert lay.has_partial() and not lay.is_replicated()
    assert lay.alias_placements == ("None", "tp")
    assert lay.without_partial().placements == (Replicate(), Shard(1))
    assert lay.replicated().placements == (Replicate(), Replicate())
    assert lay.replicated().is_replicated()


def test_tensor_map_mindspore_convention():
    base = Layout((2, 2), ("dp", "tp"))
    assert base("dp", "None").tensor_map == (1, -1)
    assert base("None", "tp").tensor_map == (-1, 0)
    assert base("tp", "dp").tensor_map == (0, 1)
    assert base(("dp", "tp"), "None").tensor_map == ((1, 0), -1)
    assert base(("tp", "dp"), "None").tensor_map == ((0, 1), -1)
    base3 = Layout((2, 2, 2), ("pp", "dp", "tp"))
    assert base3("pp", ("tp", "dp")).tensor_map == (2, (0, 1))
    assert Layout((4,), ("x",))("None", "x").tensor_map == (-1, 0)


def test_layout_hashable_and_picklable():
    import pickle
    base = Layout((2, 2), ("dp", "tp"))
    a = base(("tp", "dp"), "None")
    b = base(("tp", "dp"), "None")
    assert a == b and hash(a) == hash(b)
    assert len({a, b, base("dp", "None")}) == 2
    c = pickle.loads(pickle.dumps(a))
    assert c == a and c.alias_placements == a.alias_placements


def test_coordinate_and_rank_list():
    lay = Layout((2, 2), ("dp", "tp"), rank_list=(4, 5, 6, 7))("dp", "tp")
    assert lay.coordinate(6) == (1, 0)
    assert lay.local_shape_and_offset((4, 4), 7) == ((2, 2), (2, 2))
    with pytest.raises(ValueError, match="rank 0 is not in"):
        lay.coordinate(0)


# ------------------------------------------------------------------ errors

def test_error_placements_length():
    base = Layout((2, 2), ("dp", "tp"))
    # HyperParallel rules: missing entries are Replicate, extra trailing Replicate entries are dropped
    assert base.with_placements([Shard(0)], 2) == base.with_placements([Shard(0), Replicate()], 2)
    assert base.with_placements([Shard(0), Replicate(), Replicate()], 2).placements == (Shard(0), Replicate())
    with pytest.raises(ValueError, match=r"has 3 entries but the mesh \(2, 2\) has 2 dims; the extra entry "
                                         r"placements\[2\] = Shard\(dim=1\)"):
        base.with_placements([Shard(0), Replicate(), Shard(1)], 2)
    with pytest.raises(ValueError, match="has 4 entries"):
        base.with_placements([Shard(0), Replicate(), Replicate(), Partial()], 2)


def test_error_shard_dim_out_of_range():
    base = Layout((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"dim 2 is out of range for a 2-d tensor"):
        base.with_placements([Shard(2), Replicate()], 2)
    with pytest.raises(ValueError, match=r"placements\[1\].*dim -3 is out of range"):
        base.with_placements([Replicate(), Shard(-3)], 2)
    with pytest.raises(ValueError, match="0-d tensor cannot be sharded"):
        base.with_placements([Shard(0), Replicate()], 0)


def test_error_not_a_placement():
    base = Layout((2,), ("x",))
    with pytest.raises(TypeError, match="is not a Placement"):
        base.with_placements(["x"], 1)
    # HyperParallel's placement call form gives a PlacementSpec (tensor rank not known yet)
    assert base([Shard(0)]).placements == (Shard(0),) and base([Shard(0)]).to_layout(2).tensor_map == (0, -1)


def test_error_unknown_alias():
    base = Layout((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"unknown alias 'pp' for tensor dim 1.*\('dp', 'tp'\)"):
        base("dp", "pp")
    with pytest.raises(ValueError, match="unknown alias 'xx'"):
        base(("dp", "xx"), "None")


def test_error_alias_used_twice():
    base = Layout((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="alias 'dp' is used twice"):
        base("dp", "dp")
    with pytest.raises(ValueError, match="alias 'tp' is used twice"):
        base(("dp", "tp"), "tp")
    with pytest.raises(ValueError, match="alias 'dp' is used twice"):
        base(("dp", "dp"), "None")


def test_error_partial_in_alias_spelling():
    base = Layout((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="Partial cannot be written as an alias"):
        base(Partial(), "None")
    with pytest.raises(ValueError, match="Partial cannot be written as an alias"):
        base("partial", "None")
    with pytest.raises(TypeError, match="use either all alias names or all placement objects"):
        base(Shard(0), "None")


def test_error_none_inside_tuple_and_bad_types():
    base = Layout((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="'None' cannot appear inside a tuple"):
        base(("dp", "None"), "tp")
    with pytest.raises(TypeError, match="expected a mesh dim name"):
        base(0, "tp")


def test_error_mismatched_alias_count_vs_shape():
    lay = Layout((2, 2), ("dp", "tp"))("dp", "None")
    with pytest.raises(ValueError, match=r"global shape \(4, 4, 4\) has 3 dims but the layout describes 2"):
        lay.local_shape_and_offset((4, 4, 4), 0)


def test_error_device_matrix_only():
    base = Layout((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="describes only the device matrix"):
        base.placements
    assert "alias_names" in repr(base)


def test_error_layout_constructor():
    with pytest.raises(ValueError, match="has 1 names but mesh_shape"):
        Layout((2, 2), ("dp",))
    with pytest.raises(ValueError, match="contains duplicates"):
        Layout((2, 2), ("dp", "dp"))
    with pytest.raises(ValueError, match="'None' is not allowed"):
        Layout((2, 2), ("dp", "None"))
    with pytest.raises(ValueError, match="positive ints"):
        Layout((2, 0), ("dp", "tp"))
    with pytest.raises(ValueError, match="rank_list has 3 ranks"):
        Layout((2, 2), ("dp", "tp"), rank_list=(0, 1, 2))
