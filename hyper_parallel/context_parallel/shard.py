"""``cp_shard`` / ``cp_unshard``: lay inputs, labels, position ids and rotary tables out for context parallelism."""
from __future__ import annotations

from hyper_parallel.context_parallel.api import _flat_index
from hyper_parallel.context_parallel.order import SequenceOrder, group_key, record
from hyper_parallel.context_parallel.plan import restore_index, seg_len, shard_index, shard_layout
from hyper_parallel.dtensor.device_mesh import resolve_mesh
from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.context_parallel import torch_mechanics as _tm


def _containers(buffers, seq_dims, what):
    if isinstance(buffers, dict):
        if not isinstance(seq_dims, dict) or set(seq_dims) != set(buffers):
            raise ValueError(f"{what}: buffers is a dict, so seq_dims must be a dict with the same keys; got "
                             f"buffers keys {list(buffers)}, seq_dims {seq_dims!r}")
        keys = list(buffers)
        return [buffers[k_] for k_ in keys], [seq_dims[k_] for k_ in keys], lambda outs: dict(zip(keys, outs))
    if not isinstance(buffers, (list, tuple)) or not isinstance(seq_dims, (list, tuple)):
        raise TypeError(f"{what}: buffers and seq_dims must be lists (or dicts), got {type(buffers).__name__} and "
                        f"{type(seq_dims).__name__}")
    if len(buffers) != len(seq_dims):
        raise ValueError(f"{what}: seq_dims must have one entry per buffer, got {len(buffers)} buffers and "
                         f"{len(seq_dims)} seq_dims")
    return list(buffers), list(seq_dims), list


def _seq_dim(buffer, seq_dim, index, what):
    if not _tm.is_tensor(buffer) or isinstance(buffer, DTensor):
        raise TypeError(f"{what}: buffer {index} must be a plain tensor, got {type(buffer).__name__}")
    if not isinstance(seq_dim, int) or isinstance(seq_dim, bool) or not -buffer.dim() <= seq_dim < buffer.dim():
        raise ValueError(f"{what}: seq_dims[{index}]={seq_dim!r} is not a dim of buffer {index} "
                         f"(shape {tuple(buffer.shape)})")
    return seq_dim % buffer.dim()


def cp_shard(mesh, buffers, seq_dims, *, load_balance: bool = True):
    """This rank's shards of ``buffers`` (inputs, labels, position ids, rotary tables...) along ``seq_dims``.

    Every buffer is cut the same way (:func:`~.plan.shard_layout` of its own length): with
    ``load_balance`` rank ``r`` of the (flattened, row-major) cp mesh gets head-tail chunks ``r`` and
    ``2cp-1-r``; lengths not divisible by ``2cp`` give shards differing by at most one position, no
    padding. Returns a list (or a dict, for a dict of buffers) in the order given. The layout is
    recorded for ``mesh`` (:mod:`.order`), so the attention knows it and checks it.
    """
    what = "cp_shard"
    mesh = resolve_mesh(mesh, what)
    bufs, dims, rebuild = _containers(buffers, seq_dims, what)
    cp, f = mesh.size(), _flat_index(mesh)
    outs, first = [], None
    for i, (x, d) in enumerate(zip(bufs, dims)):
        d = _seq_dim(x, d, i, what)
        S = x.shape[d]
        layout = shard_layout(S, cp, bool(load_balance))
        outs.append(_tm.take(x, d, shard_index(layout, f)))
        if first is None:
            first = S
    if first is not None:   # the order, for the attention (checked there)
        record(group_key(mesh), SequenceOrder.from_layout(shard_layout(first, cp, bool(load_balance)),
                                                          f"cp_shard(load_balance={bool(load_balance)})"))
    return rebuild(outs)


def cp_unshard(mesh, buffers, seq_dims, *, load_balance: bool = True):
    """The inverse of :func:`cp_shard`: the whole buffers, in natural order, on every rank (for inspection)."""
    what = "cp_unshard"
    mesh = resolve_mesh(mesh, what)
    bufs, dims, rebuild = _containers(buffers, seq_dims, what)
    if mesh.ndim > 2:
        raise ValueError(f"{what}: the cp mesh must be 1-D or 2-D, got {mesh.ndim}-D {mesh}")
    impl = _tm
    cp = mesh.size()
    outs = []
    for i, (x, d) in enumerate(zip(bufs, dims)):
        d = _seq_dim(x, d, i, what)
        L = x.shape[d]
        if mesh.ndim == 1:
            g = mesh.get_comm_group(0)
            lens = impl.gather_ints(L, g, x.device)
            rows_, totals = lens, None
        else:
            g0, g1 = mesh.get_comm_group(0), mesh.get_comm_group(1)
            rows_ = impl.gather_ints(L, g1, x.device)
            totals = impl.gather_ints(sum(rows_), g0, x.device)
        S = sum(rows_) if totals is None else sum(totals)
        expect = [seg_len(s) for s in shard_layout(S, cp, bool(load_balance))]
        if totals is None:
            ok = rows_ == expect
        else:
            R = mesh.shape[1]
            u = _flat_index(mesh) // R
            ok = (rows_ == expect[u * R:(u + 1) * R]
                  and totals == [sum(expect[j * R:(j + 1) * R]) for j in range(mesh.shape[0])])
        if not ok:
            raise ValueError(f"{what}: buffer {i}'s shard lengths along dim {d} ({rows_ if totals is None else totals}"
                             f") are not cp_shard's layout of a {S}-position sequence over {cp} ranks "
                             f"(load_balance={load_balance}: {expect})")
        if totals is None:
            full = impl.all_gather(x, d, g, rows_)
        else:
            full = impl.all_gather(impl.all_gather(x, d, g1, rows_), d, g0, totals)
        idx = restore_index(shard_layout(S, cp, bool(load_balance)))
        outs.append(impl.take(full, d, idx))
    return rebuild(outs)


__all__ = ["cp_shard", "cp_unshard"]
