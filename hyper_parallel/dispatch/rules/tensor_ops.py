"""Tensor manipulation ops: joining, splitting, indexing, dim-wise ops and factories.

* ``cat`` / ``concat`` / ``concatenate`` / ``stack``: the joined dim is unsharded;
  the other dims get the same shards in every input (the cheapest input's
  layout wins). Partials survive when every input has the same ones.
* ``split`` / ``split_with_sizes`` / ``chunk`` / ``unbind`` / ``tensor_split``:
  the split dim is unsharded; every piece keeps the other shards (tensor_split with
  a 1-d index tensor: uneven shards are unsharded too, the shapes derived per call).
* ``__getitem__``: basic indexing (ints, slices, ``None``, ``Ellipsis``) keeps
  the shards of dims taken whole (``:``); dims indexed otherwise are unsharded
  first. Advanced indexing with integer tensors / lists keeps the shards of dims
  taken whole too (at their output positions, as torch places them); boolean
  masks and 0-d index tensors run replicated.
  ``__setitem__`` (in place) works when the indexed dims are unsharded and the
  target is not Partial; the value is laid out like the indexed region.
* ``narrow`` / ``select`` / ``flip`` / ``fliplr`` / ``flipud`` / ``roll``: the dims they
  work on are unsharded. (``tril`` / ``triu``: ``triangular.py``, every shard kept; ``gather`` and
  ``index_select`` compute locally on a sharded dim: ``gather_ops.py``.)
* ``*_like``: laid out like the input; ``zeros_like`` / ``empty_like`` keep
  Partial, the others are Replicate there. ``rand_like`` / ``randn_like`` (on sharded inputs) use the
  layout-independent DTensor RNG. ``new_*``: Replicate with the given global size.

Every op here is linear in its tensor input, so Partial inputs pass through
unless stated otherwise.
"""
from __future__ import annotations


from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, meta_run, redistribution_cost, unshard_dims
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt, bind_args as _bind, input_layout, uneven_dims
import torch






def _self(call):
    return input_layout(call)


def _rest(call):
    return [None] * (len(call.layouts) - 1)


def _drop_dim(layout, dim):
    dm = list(layout.dim_map)
    del dm[dim]
    return layout.with_dim_map(dm, layout.partial)


# ----------------------------------------------------------------------------- cat / stack
class CatRule(DistributedOp):
    """cat / concat / concatenate / stack (+ hstack-free): joined dim unsharded, other shards agree."""

    def __init__(self, op_name, stack=False):
        self.stack = stack
        super().__init__(op_name)

    def strategy(self, call):
        v = _bind(call.args, call.kwargs, ("tensors", "dim"))
        tensors = v.get("tensors")
        dim = v.get("dim", v.get("axis", 0))
        if not isinstance(tensors, (list, tuple)):
            raise NotImplementedError(f"{call.name}: expected a list of tensors")
        layouts, shapes = call.layouts, call.shapes
        if len(layouts) != len(tensors):
            # plain 0-d tensors mixed in (e.g. norms of plain and DTensor grads in clip_grad_norm_):
            # they are replicated values, so everything runs replicated
            tg = [l.replicated(len(sh)) for l, sh in zip(layouts, shapes)]
            out = meta_run(call.func, call.args, call.kwargs)
            return Strategy(tg, layouts[0].replicated(out.dim()))
        nd = len(shapes[0])
        if any(len(s) != nd for s in shapes):  # legacy empty (0,) tensors & co: run replicated
            tg = [l.replicated(len(s)) for l, s in zip(layouts, shapes)]
            out = meta_run(call.func, call.args, call.kwargs)
            return Strategy(tg, layouts[0].replicated(out.dim()))
        d = dim % (nd + 1) if self.stack else dim % nd
        partial = layouts[0].partial if all(l.partial == layouts[0].partial for l in layouts) else \
            (None,) * layouts[0].mesh_ndim
        cands = []
        for l in layouts:
            dm = list(l.dim_map)
            if not self.stack:
                dm[d] = ()
            dm = tuple(dm)
            if dm not in cands:
                cands.append(dm)
        best = None
        for dm in cands:
            targets = [l.with_dim_map(dm, partial) for l in layouts]
            cost = sum(redistribution_cost(l, t, s, isz) for l, t, s, isz in
                       zip(layouts, targets, shapes, call.itemsizes))
            changed = sum(1 for l, t in zip(layouts, targets) if l != t)
            if best is None or (cost, changed) < best[0]:
                best = ((cost, changed), targets, dm)
        _, targets, dm = best
        out_dm = list(dm[:d]) + [()] + list(dm[d:]) if self.stack else list(dm)
        return Strategy(targets, layouts[0].with_dim_map(out_dm, partial))


# ----------------------------------------------------------------------------- split family
class SplitRule(DistributedOp):
    """split / split_with_sizes / chunk / tensor_split / unbind: the split dim is unsharded."""

    def __init__(self, op_name, names, drop=False):
        self.names = names
        self.drop = drop
        super().__init__(op_name)

    def strategy(self, call):
        lay, shape = _self(call)
        v = _bind(call.args, call.kwargs, self.names)
        dim = v.get("dim", 0) % max(len(shape), 1)
        tgt = unshard_dims(lay, [dim]) if shape else lay
        sizes = v.get(self.names[1]) if len(self.names) > 1 else None
        if _is_tensor(sizes):  # tensor_split's indices as a tensor: see _tensor_sizes
            return self._tensor_sizes(call, lay, shape, dim, tgt, sizes)
        n = len(meta_run(call.func, call.args, call.kwargs))
        out = _drop_dim(tgt, dim) if self.drop else tgt
        return Strategy([tgt] + _rest(call), [out] * n)

    def _tensor_sizes(self, call, lay, shape, dim, tgt, sizes):
        """``tensor_split(x, tensor, dim)``: torch reads the tensor's values (it must stay on the CPU, so
        shapes cannot be inferred on the meta device), and the dispatch cache keys a tensor argument by its
        shape only. A 1-d tensor of k indices always gives k + 1 pieces; their global shapes are derived
        from each call's local pieces (the split dim is whole on every rank), so dims whose shards are
        uneven are unsharded too. A 0-d tensor (a number of sections, which sets the number of outputs)
        is refused."""
        if sizes.dim() != 1:
            raise NotImplementedError(
                f"{call.name}: {self.names[1]} as a tensor of shape {tuple(sizes.shape)} with a DTensor input: "
                "expected a 1-d tensor of indices (pass a number of sections as an int)")
        tgt = unshard_dims(tgt, uneven_dims(tgt, shape))
        out = _drop_dim(tgt, dim) if self.drop else tgt
        # (no out_shapes: meta inference fails on the index tensor, so the dispatcher derives them per call)
        return Strategy([tgt] + [l.replicated() for l in call.layouts[1:]], [out] * (sizes.shape[0] + 1))


# ----------------------------------------------------------------------------- dim-wise ops
class UnshardDimsRule(DistributedOp):
    """Ops that work along some dims (given by ``dims_of(values, ndim)``): those are unsharded first.

    ``drop`` removes the (single) dim from the output (``select``); ``partial`` says whether Partial
    inputs pass through (linear ops).
    """

    def __init__(self, op_name, names, dims_of, drop=False, partial=True):
        self.names = names
        self.dims_of = dims_of
        self.drop = drop
        self.partial = partial
        super().__init__(op_name)

    def strategy(self, call):
        lay, shape = _self(call)
        nd = len(shape)
        v = _bind(call.args, call.kwargs, self.names)
        dims = self.dims_of(v, nd)
        dims = list(range(nd)) if dims is None else [d % nd for d in dims] if nd else []
        tgt = unshard_dims(lay, dims) if nd else lay
        if not self.partial and tgt.has_partial():
            tgt = tgt.without_partial()
        out = _drop_dim(tgt, dims[0]) if self.drop and nd else tgt
        rest = []
        for a_lay in call.layouts[1:]:  # index tensors: replicated
            rest.append(a_lay.replicated())
        return Strategy([tgt] + rest, out)


def _dim(bound, ndim):
    return [bound.get("dim", 0)]


def _flip_dims(bound, ndim):
    dims = bound.get("dims")
    extra = [bound[k] for k in sorted(bound) if k.startswith("arg")]
    if isinstance(dims, int):
        dims = [dims] + [int(x) for x in extra]
    return list(dims) if dims is not None else []


def _roll_dims(bound, ndim):
    dims = bound.get("dims")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return None
    return [dims] if isinstance(dims, int) else list(dims)


# ----------------------------------------------------------------------------- indexing
def _is_int(obj):
    return isinstance(obj, int) and not isinstance(obj, bool) or (
        not isinstance(obj, (bool, slice, tuple, list)) and obj is not None and obj is not Ellipsis
        and not _is_tensor(obj) and hasattr(obj, "__index__"))


def _is_tensor(obj):
    return isinstance(obj, torch.Tensor)


def _basic_index(idx, shape, dim_map):
    """(input dim_map target, output dim_map) for basic indexing, or None when the index is advanced."""
    items = idx if isinstance(idx, tuple) else (idx,)
    for it in items:
        if not (it is None or it is Ellipsis or isinstance(it, slice) or _is_int(it)):
            return None
    nd = len(shape)
    consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
    n_ell = sum(1 for it in items if it is Ellipsis)
    if n_ell > 1 or consumed > nd:
        return None
    expanded = []
    for it in items:
        if it is Ellipsis:
            expanded.extend([slice(None)] * (nd - consumed))
        else:
            expanded.append(it)
    expanded.extend([slice(None)] * (nd - sum(1 for it in expanded if it is not None)))
    in_dm, out_dm = list(dim_map), []
    t = 0
    for it in expanded:
        if it is None:
            out_dm.append(())
            continue
        if isinstance(it, slice):
            if it.indices(shape[t]) == (0, shape[t], 1):
                out_dm.append(in_dm[t])
            else:
                in_dm[t] = ()
                out_dm.append(())
        else:
            in_dm[t] = ()
        t += 1
    return in_dm, out_dm


def _advanced_out_ndim(call, idx, ndim):
    try:
        return meta_run(call.func, call.args, call.kwargs).dim()
    except Exception:  # noqa: BLE001 - boolean masks have data-dependent shapes on meta
        pass
    items = idx if isinstance(idx, tuple) else (idx,)
    consumed = kept = adv = 0
    for it in items:
        if it is None or isinstance(it, bool):
            kept += 1
        elif it is Ellipsis:
            pass
        elif isinstance(it, slice):
            consumed += 1
            kept += 1
        elif _is_int(it):
            consumed += 1
        elif _is_tensor(it) and it.dtype == torch.bool:
            consumed += it.dim()
            adv = max(adv, 1)
        elif _is_tensor(it):
            consumed += 1
            adv = max(adv, it.dim())
        else:
            consumed += 1
            adv = max(adv, 1)
    return kept + (ndim - consumed) + adv


def _int_list(index):
    """A (nested) list of ints, no bools: an integer index tensor to torch."""
    if isinstance(index, list):
        return bool(index) and all(_int_list(e) for e in index)
    return isinstance(index, int) and not isinstance(index, bool)


def _advanced_index(idx, shape, dim_map, out_shape):
    """(input dim_map target, output dim_map) for advanced indexing with integer index tensors or lists
    (``out_shape``: the op's global output shape), or None when it cannot be told where the dims go.

    Dims taken whole (``:``, or past the index) keep their shards; dims indexed by ints, partial slices or
    index tensors are unsharded. As torch does: ints are applied first (they remove their dims), then the
    index tensors' broadcast dims replace the first of them when they are adjacent, else go first.
    """
    items = idx if isinstance(idx, tuple) else (idx,)
    if isinstance(idx, list) and not _int_list(idx):
        return None  # torch may read such a list as a tuple of indices
    nd = len(shape)
    kinds = []
    for it in items:
        if it is None or it is Ellipsis or isinstance(it, slice) or _is_int(it):
            kinds.append(it)
        elif _is_tensor(it) and it.dim() >= 1 and not it.is_floating_point() and not it.is_complex() and \
                it.dtype != torch.bool:
            kinds.append("adv")
        elif isinstance(it, list) and _int_list(it):
            kinds.append("adv")
        else:
            return None  # bool masks, 0-d tensors, bool scalars: replicated
    consumed = sum(1 for k in kinds if k is not None and k is not Ellipsis)
    n_ell = sum(1 for k in kinds if k is Ellipsis)
    if n_ell > 1 or consumed > nd or "adv" not in kinds:
        return None
    expanded = []
    for k in kinds:
        expanded.extend([slice(None)] * (nd - consumed) if k is Ellipsis else [k])
    if not n_ell:
        expanded.extend([slice(None)] * (nd - consumed))
    in_dm = list(dim_map)
    seq = []  # what remains after the ints: ("new",), ("dim", t, size, whole) or ("adv",)
    t = 0
    for k in expanded:
        if k is None:
            seq.append(("new",))
            continue
        if isinstance(k, slice):
            size = len(range(*k.indices(shape[t])))
            whole = k.indices(shape[t]) == (0, shape[t], 1)
            if not whole:
                in_dm[t] = ()
            seq.append(("dim", t, size, whole))
        elif k == "adv":
            in_dm[t] = ()
            seq.append(("adv",))
        else:
            in_dm[t] = ()
        t += 1
    adv = [i for i, e in enumerate(seq) if e[0] == "adv"]
    block = len(out_shape) - (len(seq) - len(adv))
    if block < 1:
        return None
    rest = [e for e in seq if e[0] != "adv"]
    at = adv[0] if adv == list(range(adv[0], adv[-1] + 1)) else 0
    order = rest[:at] + [("block",)] + rest[at:]
    out_dm, p = [], 0
    for e in order:
        if e[0] == "block":
            out_dm.extend([()] * block)
            p += block
            continue
        if out_shape[p] != (1 if e[0] == "new" else e[2]):
            return None
        out_dm.append(in_dm[e[1]] if e[0] == "dim" and e[3] else ())
        p += 1
    return in_dm, out_dm


class GetItemRule(DistributedOp):
    """Tensor.__getitem__ (see module docstring)."""

    def strategy(self, call):
        lay, shape = _self(call)
        idx = call.args[1]
        res = _basic_index(idx, shape, lay.dim_map)
        if res is not None:
            in_dm, out_dm = res
            return Strategy([lay.with_dim_map(in_dm, lay.partial)] + _rest(call),
                            lay.with_dim_map(out_dm, lay.partial))
        try:
            out_shape = tuple(meta_run(call.func, call.args, call.kwargs).shape)
        except Exception:  # noqa: BLE001 - boolean masks have data-dependent shapes on meta
            out_shape = None
        res = None if out_shape is None else _advanced_index(idx, shape, lay.dim_map, out_shape)
        if res is not None:
            in_dm, out_dm = res
            rest = [l.replicated() for l in call.layouts[1:]]
            return Strategy([lay.with_dim_map(in_dm, lay.partial)] + rest, lay.with_dim_map(out_dm, lay.partial))
        nd_out = len(out_shape) if out_shape is not None else _advanced_out_ndim(call, idx, len(shape))
        tgt = lay.with_dim_map(((),) * len(shape), lay.partial)
        rest = [l.replicated() for l in call.layouts[1:]]
        return Strategy([tgt] + rest, lay.with_dim_map(((),) * nd_out, lay.partial))


class SetItemRule(DistributedOp):
    """Tensor.__setitem__(idx, value), in place: the indexed dims must already be unsharded."""

    def strategy(self, call):
        lay, shape = _self(call)
        idx, value = call.args[1], call.args[2]
        if lay.has_partial():
            raise RuntimeError(f"__setitem__ on a DTensor with placements {lay.placements}: the target is Partial; "
                               "call reduce_partial() first")
        if _is_dt(idx) and call.shapes[1] == tuple(shape) and not _is_dt(value) and \
                call.dtensor_args[1].dtype == torch.bool:
            # x[mask] = scalar with a DTensor mask of x's shape: elementwise, the mask laid out like x
            def local_fn(local, mask, value):
                local[mask] = value
                return local  # (the statement ``x[m] = v`` discards it; cached fast calls need a tensor)
            return Strategy([lay, lay.without_partial()], lay, local_fn=local_fn, out_shapes=torch.Size(shape))
        res = _basic_index(idx, shape, lay.dim_map)
        if res is None:
            in_dm, out_dm = [()] * len(shape), None
        else:
            in_dm, out_dm = res
        tgt = lay.with_dim_map(in_dm, lay.partial)
        if tgt != lay:
            raise RuntimeError(f"__setitem__: indexing {idx!r} touches sharded dims of a DTensor with placements "
                               f"{lay.placements}; in place it cannot change its layout. Redistribute first "
                               "(e.g. to Replicate on the indexed dims)")
        targets = [lay]
        if _is_dt(value):
            vlay, vshape = call.layouts[1], call.shapes[1]
            if out_dm is None:
                vtgt = vlay.replicated()
            else:
                region = meta_run(lambda x: x[idx], (call.args[0],), {}).shape
                off = len(region) - len(vshape)
                vdm = []
                for i, s in enumerate(vshape):
                    j = off + i
                    vdm.append(out_dm[j] if j >= 0 and s == region[j] else ())
                vtgt = vlay.with_dim_map(vdm, (None,) * vlay.mesh_ndim)
            targets.append(vtgt)
        targets += [l.replicated() for l in call.layouts[len(targets):]]
        return Strategy(targets, lay, out_shapes=torch.Size(shape))


# ----------------------------------------------------------------------------- factories
class LikeRule(DistributedOp):
    """zeros_like & co: laid out like the input; ``keep_partial`` for zeros_like / empty_like."""

    def __init__(self, op_name, keep_partial=False, random_kind=None):
        self.keep_partial = keep_partial
        self.random_kind = random_kind
        super().__init__(op_name)

    def strategy(self, call):
        lay, shape = _self(call)
        out = lay if self.keep_partial else lay.without_partial()
        local_fn = None
        if self.random_kind is not None:
            from hyper_parallel.dispatch.rules.random_ops import torch_draws
            whole = torch_draws(call, out_layout=out, out_shapes=torch.Size(shape))
            if whole is not None:  # replicated input: torch's own rand_like / randn_like
                return whole
            kind = self.random_kind
            lshape, offset = out.local_shape_and_offset(shape, coord=call.mesh.get_coordinate())

            def local_fn(local, *args, **kwargs):
                from hyper_parallel.dtensor.random import random_local
                t = random_local(kind, shape, lshape, offset, kwargs.get("dtype") or local.dtype,
                                 kwargs.get("device") or local.device)
                if kwargs.get("requires_grad"):
                    t.requires_grad_()
                return t
        return Strategy([lay] + _rest(call), out, local_fn=local_fn, out_shapes=torch.Size(shape))


class NewRule(DistributedOp):
    """new_zeros / new_ones / new_empty / new_full / new_tensor: Replicate, the given global size."""

    def strategy(self, call):
        lay, _ = _self(call)
        if len(call.layouts) > 1:
            raise NotImplementedError(f"{call.name}: DTensor data/size arguments are not supported")
        out = meta_run(call.func, call.args, call.kwargs)
        return Strategy([lay], lay.replicated(out.dim()), out_shapes=torch.Size(out.shape))


# ----------------------------------------------------------------------------- registration
def register_all():
    for n in ("cat", "concat", "concatenate"):
        CatRule(n)
    CatRule("stack", stack=True)
    SplitRule("split", ("input", "split_size_or_sections", "dim"))
    SplitRule("split_with_sizes", ("input", "split_sizes", "dim"))
    SplitRule("chunk", ("input", "chunks", "dim"))
    SplitRule("tensor_split", ("input", "indices_or_sections", "dim"))
    SplitRule("unbind", ("input", "dim"), drop=True)
    GetItemRule("__getitem__")
    SetItemRule("__setitem__")
    UnshardDimsRule("narrow", ("input", "dim", "start", "length"), _dim)
    UnshardDimsRule("select", ("input", "dim", "index"), _dim, drop=True)
    UnshardDimsRule("flip", ("input", "dims"), _flip_dims)
    UnshardDimsRule("fliplr", ("input",), lambda v, nd: [1])
    UnshardDimsRule("flipud", ("input",), lambda v, nd: [0])
    UnshardDimsRule("roll", ("input", "shifts", "dims"), _roll_dims)
    LikeRule("zeros_like", keep_partial=True)
    LikeRule("empty_like", keep_partial=True)
    LikeRule("ones_like")
    LikeRule("full_like")
    LikeRule("rand_like", random_kind="rand")
    LikeRule("randn_like", random_kind="randn")
    for n in ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"):
        NewRule(n)
