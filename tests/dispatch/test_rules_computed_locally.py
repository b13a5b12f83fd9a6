"""tril / triu, tensor_split, advanced __getitem__, pad and repeat_interleave layouts that compute locally.

HyperParallel computes these layouts on each rank's piece (its cases pass under strict layouts):
``tril`` / ``triu`` on row / column shards (diagonal shifted by the piece's row offset minus its
column offset), ``tensor_split`` with a tensor of indices, advanced indexing that takes other dims
whole, ``pad`` with ``(0, 0)`` on a sharded dim, ``repeat_interleave(x, r)`` (``dim=None``) of a
row-sharded tensor. For each: the forward runs with no collective under ``hp.strict_layouts()``, the
output has the expected placements, and values and gradients equal one process in float64 at 1e-10.
Uneven pieces, pieces over two mesh dims and Partial inputs are included; layouts that cannot be
computed locally still redistribute, raise under strict layouts and give one process's results
without them. The input is also accepted by keyword (``torch.tril(input=x)``, ``F.pad(input=x)``).
"""
import pytest
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Partial, Replicate, Shard

from tests.harness.parity import _randn, check_local, check_redistributes

TOL = dict(rtol=1e-10, atol=1e-10)
R, S0, S1, S2, S3, P = Replicate(), Shard(0), Shard(1), Shard(2), Shard(3), Partial()








def _tri_cases(mesh, k):
    """tril / triu on (rows, cols) shards of a mesh dim of size ``k`` (1-d mesh): even and uneven."""
    n = 0
    for op in (torch.tril, torch.triu):
        for shape in ((6, 8), (7, 5), (3, 2 * k + 1, 9)):
            for pl in ([Shard(len(shape) - 2)], [Shard(len(shape) - 1)], [P]):
                for diag in (0, 1, -1, 9, -7):
                    _run(f"{op.__name__} {shape} {pl} {diag}", mesh, lambda x, op=op, d=diag: op(x, d),
                         [(_randn(*shape, seed=n), pl)], pl)
                    n += 1
    # HyperParallel: tril_ops_row_sharded, tril_ops_col_sharded, tril_ops_diagonal_above_width,
    # tril_ops_diagonal_below_height; the method form and the keyword form (tril_ops_batch_dp)
    _run("tril row", mesh, torch.tril, [(_randn(6, 8), [S0])], [S0])
    _run("tril col", mesh, torch.tril, [(_randn(6, 8), [S1])], [S1])
    _run("tril 9 row", mesh, lambda x: torch.tril(x, 9), [(_randn(6, 8), [S0])], [S0])
    _run("tril -7 col", mesh, lambda x: torch.tril(x, -7), [(_randn(6, 8), [S1])], [S1])
    _run("Tensor.triu", mesh, lambda x: x.triu(diagonal=2), [(_randn(5, 6), [S1])], [S1])
    _run("tril input=", mesh, lambda x: torch.tril(input=x, diagonal=1), [(_randn(4, 6, 8), [S0])], [S0])
    return n + 6


# ----------------------------------------------------------------------------- 1-d meshes
def _mesh1d_body():
    ws = torch.distributed.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    n = _tri_cases(mesh, ws)

    # tensor_split with a 1-d index tensor (HyperParallel: tensor_split_ops_1d_tensor_indices)
    _run("tensor_split tensor", mesh, lambda x: x.tensor_split(torch.tensor([1, 4]), dim=1),
         [(_randn(8, 6), [S0])], [S0])
    _run("torch.tensor_split tensor", mesh, lambda x: torch.tensor_split(x, torch.tensor([2, 2, 5]), 0),
         [(_randn(7, 2 * ws), [S1])], [S1])
    # the dispatch cache keys the index tensor by its shape: other values, same shape, still right
    x = hp.distribute_tensor(_randn(8, 6), mesh, [S0])
    for idx in ([1, 4], [3, 5], [0, 6]):
        got = x.tensor_split(torch.tensor(idx), dim=1)
        want = _randn(8, 6).tensor_split(idx, dim=1)
        assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want], idx
        for g, w in zip(got, want):
            torch.testing.assert_close(g.full_tensor(), w, **TOL)
    with pytest.raises(NotImplementedError, match=r"indices_or_sections as a tensor of shape \(\)"):
        x.tensor_split(torch.tensor(2), dim=1)
    n += 3
    # rows uneven (5 over ws) with the index tensor: the row shards are gathered (shapes come per call)
    _gathers("tensor_split tensor uneven", mesh, lambda x: x.tensor_split(torch.tensor([1]), dim=1),
                   [(_randn(5, 4), [S0])], [R], "tensor_split")

    # advanced indexing: dims taken whole keep their shards (at their output positions)
    _run("getitem list", mesh, lambda x: x[[0, 2]], [(_randn(8, 6), [S1])], [S1])
    _run("getitem list dup uneven", mesh, lambda x: x[[2, 0, 2, 1]], [(_randn(3, 2 * ws + 1), [S1])], [S1])
    _run("getitem tensor mid", mesh, lambda x: x[:, torch.tensor([[1, 0], [2, 2]])],
         [(_randn(5, 3, 7), [S2])], [S3])
    _run("getitem two adv apart", mesh, lambda x: x[:, [0, 1], 1:3, [1, 0]],
         [(_randn(2 * ws, 3, 4, 5), [S0])], [S1])
    _run("getitem int + list", mesh, lambda x: x[1, :, [0, 2]], [(_randn(3, 5, 4), [S1])], [S0])
    _run("getitem partial", mesh, lambda x: x[..., [3, 1]], [(_randn(4, 5), [P])], [P])
    n += 6
    _gathers("getitem list on the sharded dim", mesh, lambda x: x[[0, 2]],
                   [(_randn(8, 6), [S0])], [R], "__getitem__")

    # pad: a dim padded by (0, 0) keeps its shards (HyperParallel: pad_ops_zero_on_sharded_dim)
    _run("pad zero on sharded", mesh, lambda x: F.pad(x, (1, 1, 0, 0, 0, 0, 0, 0)),
         [(_randn(4, 4, 8, 8), [S0])], [S0])
    _run("pad (0, 0) inner dim", mesh, lambda x: F.pad(x, (2, 1, 0, 0), value=0.0),
         [(_randn(3, 2 * ws + 1, 5), [S1])], [S1])
    _run("pad reflect", mesh, lambda x: F.pad(x, (1, 2, 0, 0), mode="reflect"),
         [(_randn(2, 3, 5, 6), [S2])], [S2])
    _run("pad input=", mesh, lambda x: F.pad(input=x, pad=(1, 0)), [(_randn(6, 3), [S0])], [S0])
    # 3 over 4 ranks: one empty piece, which torch's replicate/reflect kernels refuse
    _run("pad replicate empty piece", mesh, lambda x: F.pad(x, (1, 1), mode="replicate"),
         [(_randn(2, 3, 4), [S1])], [S1])
    n += 5
    _gathers("pad on the sharded dim", mesh, lambda x: F.pad(x, (0, 0, 1, 0)),
                   [(_randn(6, 3), [S0])], [R], "pad")

    # repeat_interleave, dim=None (HyperParallel: repeat_interleave_ops_dim_none)
    _run("repeat_interleave flat", mesh, lambda x: torch.repeat_interleave(x, 3), [(_randn(8, 16), [S0])], [S0])
    _run("repeat_interleave flat 3-d", mesh, lambda x: x.repeat_interleave(repeats=2),
         [(_randn(2 * ws, 3, 2), [S0])], [S0])
    _run("repeat_interleave flat partial", mesh, lambda x: x.repeat_interleave(2), [(_randn(4, 3), [P])], [P])
    n += 3
    # 5 rows x 6 elements: on 2 ranks 18 + 12, not torch.chunk's 15 + 15 (4 ranks alike) -> gathered
    _gathers("repeat_interleave flat uneven", mesh, lambda x: torch.repeat_interleave(x, 3),
                   [(_randn(5, 2), [S0])], [R], "repeat_interleave")
    return n


def test_local_rules_on_1d_meshes(dist_runner):
    assert dist_runner.run(2, _mesh1d_body) == [113] * 2
    assert dist_runner.run(4, _mesh1d_body) == [113] * 4


# ----------------------------------------------------------------------------- (2, 2) mesh, 4 ranks
def _mesh22_body():
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    n = 0
    # tril / triu: rows and cols on the two mesh dims (HyperParallel: tril_ops_row_col_sharded),
    # batch + rows with the keyword form (tril_ops_hybrid_batch_row), rows over both mesh dims
    # (nested, uneven: 7 rows -> 4 + 3 -> 2 + 2 + 2 + 1), cols over both, Partial with a shard
    for op in (torch.tril, torch.triu):
        for d in (-1, 0, 2):
            _run(f"{op.__name__} row col {d}", mesh, lambda x, op=op, d=d: op(x, d),
                 [(_randn(6, 8), [S0, S1])], [S0, S1])
            _run(f"{op.__name__} col row {d}", mesh, lambda x, op=op, d=d: op(x, d),
                 [(_randn(7, 5), [S1, S0])], [S1, S0])
            _run(f"{op.__name__} rows nested {d}", mesh, lambda x, op=op, d=d: op(x, diagonal=d),
                 [(_randn(7, 9), [S0, S0])], [S0, S0])
            _run(f"{op.__name__} cols nested {d}", mesh, lambda x, op=op, d=d: op(x, d),
                 [(_randn(2, 5, 9), [S2, S2])], [S2, S2])
            _run(f"{op.__name__} partial col {d}", mesh, lambda x, op=op, d=d: op(x, d),
                 [(_randn(3, 6, 5), [P, S2])], [P, S2])
            n += 5
    _run("tril batch dp keyword", mesh, lambda x: torch.tril(input=x, diagonal=1), [(_randn(4, 6, 8), [S0, R])],
         [S0, R])
    _run("tril batch row keyword", mesh, lambda x: torch.tril(input=x, diagonal=1),
         [(_randn(4, 6, 8), [S0, S1])], [S0, S1])
    n += 2
    # tensor_split / getitem / pad / repeat_interleave: HyperParallel's (2, 2) cases and a few more
    _run("tensor_split tensor dp", mesh, lambda x: x.tensor_split(torch.tensor([1, 4]), dim=1),
         [(_randn(8, 6), [S0, R])], [S0, R])
    _run("getitem advanced keep shard", mesh, lambda x: x[[0, 2]], [(_randn(8, 6), [R, S1])], [R, S1])
    _run("getitem adv both kept", mesh, lambda x: x[:, [4, 0, 4]], [(_randn(6, 5, 7), [S2, S0])], [S2, S0])
    _run("pad zero on sharded dp", mesh, lambda x: F.pad(x, (1, 1, 0, 0, 0, 0, 0, 0)),
         [(_randn(4, 4, 8, 8), [S0, R])], [S0, R])
    _run("pad two kept", mesh, lambda x: F.pad(x, (0, 3, 0, 0, 0, 0)),
         [(_randn(5, 3, 4), [S1, S0])], [S1, S0])
    _run("repeat_interleave dim none", mesh, lambda x: torch.repeat_interleave(x, 3), [(_randn(8, 16), [S0, R])],
         [S0, R])
    _run("repeat_interleave rows nested", mesh, lambda x: torch.repeat_interleave(x, 2),
         [(_randn(8, 3), [S0, S0])], [S0, S0])
    _run("repeat_interleave dp partial", mesh, lambda x: torch.repeat_interleave(x, 2),
         [(_randn(4, 3), [S0, P])], [S0, P])
    n += 8
    # 6 rows over (2, 2) -> 2 + 1 + 2 + 1 (nested chunks) x 2 each; the output's 12 -> 3 + 3 + 3 + 3
    _gathers("repeat_interleave rows nested uneven", mesh, lambda x: torch.repeat_interleave(x, 2),
                   [(_randn(6, 1), [S0, S0])], [R, R], "repeat_interleave")
    return n


def test_local_rules_on_2x2(dist_runner):
    assert dist_runner.run(4, _mesh22_body) == [40] * 4


def _run(label, mesh, f, inputs, placements):
    check_local(label, mesh, f, inputs, placements, tol=TOL)


def _gathers(label, mesh, f, inputs, placements, match):
    check_redistributes(label, mesh, f, inputs, placements, match, tol=TOL)
