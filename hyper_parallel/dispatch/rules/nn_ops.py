"""Neural-network ops: softmax family, norms, embedding, dropout, losses, attention, scans.

Every rule here picks target input layouts (the dispatcher redistributes to
them) and output layouts; some add a local implementation (``local_fn``, same
signature as the op) that makes a sharded computation exact:

* ``softmax`` / ``log_softmax`` / ``softmin``: the softmax dim is unsharded,
  other shards kept; Partial inputs are reduced.
* ``layer_norm`` / ``rms_norm``: the normalized (trailing) dims are unsharded,
  the others keep their shards (sequence parallel); weight/bias are replicated.
* ``embedding``: ids keep their shards; a weight sharded on the embedding dim
  shards the output's last dim; a weight sharded on the vocab rows ("vocab
  parallel") looks up only its own rows (other ids give zero rows) and the
  output is ``Partial(sum)``; ``scale_grad_by_freq=True`` keeps these layouts and
  scales the weight gradient by global frequencies (counts all_reduced in backward).
* ``dropout``: on a sharded or Partial input the mask comes from the
  layout-independent DTensor RNG, so the result does not depend on the mesh or
  the sharding; on a replicated input it is torch's own dropout (``random_ops.py``).
* ``cross_entropy`` / ``nll_loss``: the class dim is unsharded; batch shards
  give a local loss; ``sum`` -> ``Partial(sum)``; ``mean`` divides the local sum
  by the global (all-reduced) count / weight sum -> ``Partial(sum)``, exact for
  uneven shards; ``none`` -> sharded like the target.
* ``scaled_dot_product_attention``: batch and head shards pass through (q, k, v
  and the mask agree); a query sharded on the sequence dim keeps that shard
  when K/V are (made) whole: each rank attends its rows, ``is_causal`` masks at
  the rows' global offsets, an ``attn_mask`` over query rows is sharded alike
  and a plain-tensor mask is taken as replicated. Otherwise sequence and
  feature dims are unsharded. ``dropout_p > 0``: the same layouts with the
  layout-independent attention dropout of ``attention_dropout.py``.
* ``cumsum`` & co: the scan dim is unsharded (``cumsum`` keeps ``Partial(sum)``).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from hyper_parallel.dtensor.layout import Layout
from hyper_parallel.dispatch.rules.base import (
    PLAIN_AS_REPLICATED, DistributedOp, Strategy, redistribution_cost, reduce_all_partial, unshard_dims)
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt, bind_args as _bind
from hyper_parallel.dispatch.rules.base import register_decomposition
from hyper_parallel.distributed import collectives
import torch


# ----------------------------------------------------------------------------- argument helpers




def _roles(call, names: Sequence[str]) -> List[str]:
    """The argument name of every DTensor in ``call.dtensor_args`` (same walk as the dispatcher)."""
    out = []

    def walk(arg, name):
        if _is_dt(arg):
            out.append(name)
        elif isinstance(arg, (list, tuple)):
            for x in arg:
                walk(x, name)
    for i, a in enumerate(call.args):
        walk(a, names[i] if i < len(names) else f"arg{i}")
    for k, a in call.kwargs.items():
        walk(a, k)
    return out


class _Args:
    """What a rule needs about one call: values, per-DTensor roles, layouts and shapes by role."""

    def __init__(self, call, names):
        self.call = call
        self.names = names
        self.v = _bind(call.args, call.kwargs, names)
        self.roles = _roles(call, names)
        self.layout = {}
        self.shape = {}
        self._itemsize = {}
        for r, lay, shp, isz in zip(self.roles, call.layouts, call.shapes, call.itemsizes):
            self.layout.setdefault(r, lay)
            self.shape.setdefault(r, shp)
            self._itemsize.setdefault(r, isz)

    def itemsize(self, name):
        return self._itemsize[name]

    def get(self, name, default=None):
        return self.v.get(name, default)

    def is_dt(self, name):
        return name in self.layout

    def targets(self, tgt: Dict[str, Layout]):
        """Target layout for every DTensor input (``None`` = keep), in dispatcher order."""
        return [tgt.get(r) for r in self.roles]

    def cost(self, tgt: Dict[str, Layout]):
        c = 0
        for r, lay, shp, isz in zip(self.roles, self.call.layouts, self.call.shapes, self.call.itemsizes):
            t = tgt.get(r)
            if t is not None:
                c += redistribution_cost(lay, t, shp, isz)
        return c


def _drop_mesh_dims(layout: Layout, mesh_dims) -> Layout:
    """``layout`` without shards on ``mesh_dims`` (partials untouched)."""
    mesh_dims = set(mesh_dims)
    dm = tuple(tuple(d for d in m if d not in mesh_dims) for m in layout.dim_map)
    return layout if dm == layout.dim_map else layout.with_dim_map(dm, layout.partial)


def _coord(call):
    return call.mesh.get_coordinate()


# ----------------------------------------------------------------------------- softmax family
class SoftmaxRule(DistributedOp):
    """softmax / log_softmax / softmin (functional, torch.* and Tensor methods): softmax dim unsharded."""

    def strategy(self, call):
        a = _Args(call, ("input", "dim"))
        if not a.is_dt("input"):
            raise NotImplementedError(f"{call.name}: the input must be a DTensor")
        lay, shape = a.layout["input"], a.shape["input"]
        nd = len(shape)
        dim = a.get("dim")
        if dim is None:  # F.softmax's implicit dim (deprecated in torch)
            dim = 0 if nd in (0, 1, 3) else 1
        tgt = reduce_all_partial(lay)
        if nd:
            tgt = unshard_dims(tgt, [dim])
        return Strategy(a.targets({"input": tgt}), tgt)


# ----------------------------------------------------------------------------- scans
class ScanRule(DistributedOp):
    """cumsum / cumprod / logcumsumexp / cummax / cummin (+ in-place): scan dim unsharded."""

    def __init__(self, op_name, linear=False, n_out=1):
        self.linear = linear
        self.n_out = n_out
        super().__init__(op_name)

    def strategy(self, call):
        from hyper_parallel.dispatch.rules.base import is_inplace
        a = _Args(call, ("input", "dim"))
        if not a.is_dt("input"):
            raise NotImplementedError(f"{call.name}: the input must be a DTensor")
        lay, shape = a.layout["input"], a.shape["input"]
        dim = a.get("dim")
        if dim is None:
            raise TypeError(f"{call.name}: missing the 'dim' argument")
        tgt = lay
        if lay.has_partial():
            keep = self.linear and set(p for p in lay.partial if p is not None) <= {"sum"}
            if not keep:
                tgt = reduce_all_partial(lay)
        if shape:
            tgt = unshard_dims(tgt, [dim])
        if is_inplace(call.name) and tgt != lay:
            raise RuntimeError(f"{call.name}: in-place op on a DTensor with placements {lay.placements} would change "
                               f"its layout to {tgt.placements}; redistribute first or use the out-of-place op")
        out = tgt
        if self.n_out > 1:
            out = [out] + [tgt.without_partial()] * (self.n_out - 1)
        return Strategy(a.targets({"input": tgt}), out)


# ----------------------------------------------------------------------------- normalization
class NormRule(DistributedOp):
    """layer_norm(input, normalized_shape, weight, bias, eps) / rms_norm(input, normalized_shape, weight, eps)."""

    def __init__(self, op_name, names):
        self.names = names
        super().__init__(op_name)

    def strategy(self, call):
        a = _Args(call, self.names)
        if not a.is_dt("input"):
            raise NotImplementedError(f"{call.name}: the input must be a DTensor (got a DTensor weight/bias only)")
        lay, shape = a.layout["input"], a.shape["input"]
        ns = a.get("normalized_shape")
        k = 1 if isinstance(ns, int) else len(ns)
        tgt = reduce_all_partial(lay)
        tgt = unshard_dims(tgt, list(range(len(shape) - k, len(shape))))
        t = {"input": tgt}
        for r in ("weight", "bias"):
            if a.is_dt(r):
                t[r] = a.layout[r].replicated()
        return Strategy(a.targets(t), tgt)


# ----------------------------------------------------------------------------- embedding
_F_EMB_NAMES = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
_T_EMB_NAMES = ("weight", "input", "padding_idx", "scale_grad_by_freq", "sparse")


class EmbeddingRule(DistributedOp):
    """F.embedding(input, weight, ...) and torch.embedding(weight, input, ...).

    weight ``Shard(0)`` (vocab rows) -> each rank looks up its rows only and the
    output is ``Partial(sum)``; weight ``Shard(1)`` -> output sharded on its last
    dim; ids keep their shards on the other mesh dims.
    """

    def strategy(self, call):
        functional = call.func is not torch.embedding
        names = _F_EMB_NAMES if functional else _T_EMB_NAMES
        a = _Args(call, names)
        if not a.is_dt("weight") or not a.is_dt("input"):
            raise NotImplementedError(f"{call.name}: both the ids and the weight must be DTensors "
                                      "(use hyper_parallel.implicit_replication() for plain ids)")
        ids, w = a.layout["input"], a.layout["weight"]
        wshape = a.shape["weight"]
        if ids.has_partial():
            raise ValueError(f"{call.name}: the ids have a Partial placement ({ids.placements}); "
                             "token ids cannot be pending sums - reduce them first")
        w = reduce_all_partial(w)
        if a.get("max_norm") is not None:
            # max_norm renormalizes the looked-up rows of the weight in place: keep it whole
            w = w.replicated()
        scale = bool(a.get("scale_grad_by_freq", False))
        if scale and a.get("max_norm") is not None:
            # max_norm renormalizes the weight in place: frequencies counted on whole ids (torch's own kernel)
            ids = ids.replicated()
            scale = False
        # candidate A: keep the weight, drop conflicting id shards; B: keep the ids, drop weight shards
        cands = []
        wdims = set(w.dim_map[0]) | set(w.dim_map[1])
        cands.append({"input": _drop_mesh_dims(ids, wdims), "weight": w})
        idims = set(ids.sharded_mesh_dims())
        if idims & wdims:
            cands.append({"input": ids, "weight": _drop_mesh_dims(w, idims)})
        out_shape = torch.Size(tuple(a.shape["input"]) + (wshape[1],))

        def output(cand):
            ti, tw = cand["input"], cand["weight"]
            partial = [None] * tw.mesh_ndim
            for d in tw.dim_map[0]:
                partial[d] = "sum"
            return ti.with_dim_map(tuple(ti.dim_map) + (tuple(tw.dim_map[1]),), partial)

        def cost(cand):
            # a vocab-sharded weight leaves a Partial output that will be reduced: when the ids
            # and the weight are sharded on the same mesh dim, gathering the (small) weight can
            # beat gathering the ids and then reducing the output (vmap'd embeddings, torch's
            # choice there); the reduction is priced as an all_reduce of the output
            out = output(cand)
            later = redistribution_cost(out, out.without_partial(), out_shape, a.itemsize("weight")) \
                if len(cands) > 1 and out.has_partial() else 0
            return a.cost(cand) + later

        best = min(cands, key=cost)
        ti, tw = best["input"], best["weight"]
        rows_dims = tw.dim_map[0]
        out = output(best)
        local_fn = None
        start, rows = 0, wshape[0]
        if rows_dims:
            lshape, off = tw.local_shape_and_offset(wshape, coord=_coord(call))
            start, rows = off[0], lshape[0]
            local_fn = _vocab_parallel_embedding(names, start, rows, wshape[0])
        if scale:
            # the ids keep their shards: the gradient is scaled by the GLOBAL frequency of each row
            # (per-row counts all_reduced over the mesh dims sharding the ids, in backward)
            groups = [call.mesh.get_comm_group(d) for d in ti.sharded_mesh_dims() if call.mesh.size(d) > 1]
            local_fn = _freq_scaled_embedding(names, local_fn, start, rows, wshape[0], groups)
        return Strategy(a.targets(best), out, local_fn=local_fn, out_shapes=out_shape)


class _GlobalFreqGradScale(torch.autograd.Function):
    """Identity on the (local) weight; backward divides each row's gradient by the number of times
    its id occurs in the whole (global) ids tensor: local counts all_reduced over ``groups``."""

    @staticmethod
    def forward(ctx, weight, ids, start, vocab, groups):
        ctx.save_for_backward(ids)
        ctx.start, ctx.vocab, ctx.groups = start, vocab, groups
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad_output):
        ids, = ctx.saved_tensors
        counts = torch.bincount(ids.reshape(-1), minlength=ctx.vocab)
        for grp in ctx.groups:
            counts = collectives.all_reduce(counts, grp, "sum")
        counts = counts[ctx.start:ctx.start + grad_output.shape[0]].clamp(min=1).to(grad_output.dtype)
        return grad_output / counts.reshape((-1,) + (1,) * (grad_output.dim() - 1)), None, None, None, None


def _freq_scaled_embedding(names, inner, start, rows, vocab, groups):
    """``scale_grad_by_freq=True`` with global frequencies: the lookup runs unscaled (``inner``, or
    F.embedding) on a weight whose gradient :class:`_GlobalFreqGradScale` scales."""
    F = torch.nn.functional

    def fn(*args, **kwargs):
        v = _bind(args, kwargs, names)
        ids, w = v["input"], v["weight"]
        if w.requires_grad and rows:
            w = _GlobalFreqGradScale.apply(w, ids, start, vocab, groups)
        if inner is not None:
            return inner(**dict(v, weight=w, scale_grad_by_freq=False))
        return F.embedding(ids, w, v.get("padding_idx"), v.get("max_norm"), v.get("norm_type", 2.0), False,
                           v.get("sparse", False))
    return fn


def _vocab_parallel_embedding(names, start, rows, vocab):
    F = torch.nn.functional

    def fn(*args, **kwargs):
        v = _bind(args, kwargs, names)
        ids, w = v["input"], v["weight"]
        if rows == 0:
            # this rank holds no rows: zeros, still connected to the (empty) weight for autograd
            return w.new_zeros(tuple(ids.shape) + (w.shape[-1],)) + w.sum() * 0
        pad = v.get("padding_idx")
        if pad is not None:
            if pad < 0:
                pad += vocab
            pad = pad - start if start <= pad < start + rows else None
        outside = (ids < start) | (ids >= start + rows)
        local_ids = (ids - start).masked_fill(outside, 0)
        out = F.embedding(local_ids, w, pad, None, v.get("norm_type", 2.0), v.get("scale_grad_by_freq", False),
                          v.get("sparse", False))
        return out.masked_fill(outside.unsqueeze(-1), 0)
    return fn


# ----------------------------------------------------------------------------- dropout
_F_DROPOUT_NAMES = ("input", "p", "training", "inplace")
_T_DROPOUT_NAMES = ("input", "p", "train")


class DropoutRule(DistributedOp):
    """F.dropout(input, p, training, inplace) / torch.dropout(input, p, train) with a layout-independent mask."""

    float_args_matter = True  # p is baked into the local function

    def strategy(self, call):
        functional = call.func is not torch.dropout
        names = _F_DROPOUT_NAMES if functional else _T_DROPOUT_NAMES
        a = _Args(call, names)
        if not a.is_dt("input"):
            raise NotImplementedError(f"{call.name}: the input must be a DTensor")
        lay, shape = a.layout["input"], a.shape["input"]
        p = float(a.get("p", 0.5))
        training = bool(a.get("training" if functional else "train", True))
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{call.name}: dropout probability has to be between 0 and 1, but got {p}")
        if not training or p == 0.0:
            return Strategy(a.targets({}), lay, out_shapes=torch.Size(shape))
        from hyper_parallel.dispatch.rules.random_ops import torch_draws
        whole = torch_draws(call, out_shapes=torch.Size(shape))  # replicated input: torch's own dropout
        if whole is not None:
            return whole
        tgt = reduce_all_partial(lay)
        lshape, off = tgt.local_shape_and_offset(shape, coord=_coord(call))
        inplace = bool(a.get("inplace", False)) and functional
        return Strategy(a.targets({"input": tgt}), tgt, out_shapes=torch.Size(shape),
                        local_fn=_dropout_fn(names, p, tuple(shape), lshape, off, inplace))


def _dropout_fn(names, dropout_p, gshape, lshape, offset, inplace):
    from hyper_parallel.dtensor.random import random_local
    ops = torch

    def fn(*args, **kwargs):
        x = _bind(args, kwargs, names)["input"]
        u = random_local("rand", gshape, lshape, offset, dtype=ops.float32, device=x.device)
        if dropout_p == 1.0:
            return x.mul_(0) if inplace else x * 0
        keep = (u >= dropout_p).to(x.dtype) * (1.0 / (1.0 - dropout_p))
        return x.mul_(keep) if inplace else x * keep
    return fn


# ----------------------------------------------------------------------------- losses
_CE_NAMES = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
_NLL_NAMES = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")


class ClassLossRule(DistributedOp):
    """cross_entropy / nll_loss: class dim (1, or 0 for 1-d input) unsharded, batch shards local.

    The vocab-parallel loss (class dim sharded, no gather) is not implemented
    here: a sharded class dim is gathered.
    """

    def __init__(self, op_name, names):
        self.names = names
        super().__init__(op_name)

    def strategy(self, call):
        a = _Args(call, self.names)
        if not a.is_dt("input"):
            raise NotImplementedError(f"{call.name}: the input (logits) must be a DTensor")
        xl, xs = a.layout["input"], a.shape["input"]
        n = len(xs)
        reduction = a.get("reduction", "mean")
        if a.get("size_average") is not None or a.get("reduce") is not None:
            reduction = torch.nn.functional._Reduction.legacy_get_string(a.get("size_average"), a.get("reduce"))
        ts = a.shape.get("target")
        tl = a.layout.get("target")
        prob_target = False
        if ts is not None and tuple(ts) == tuple(xs) and call.name == "cross_entropy":
            tgt_dt = [d for d, r in zip(call.dtensor_args, a.roles) if r == "target"][0]
            prob_target = tgt_dt.is_floating_point()
        cdim = 1 if n >= 2 else 0
        batch = [t for t in range(n) if t != cdim]

        def t_of(input_dim):  # input dim -> target dim
            return input_dim if prob_target or input_dim < cdim else input_dim - 1

        def make(bdm):
            used = [d for t in batch for d in bdm[t]]
            xdm = [bdm[t] if t != cdim else () for t in range(n)]
            res = {"input": xl.with_dim_map(xdm, None)}
            if tl is not None:
                tdm = [()] * len(ts)
                for t in batch:
                    tdm[t_of(t)] = bdm[t]
                res["target"] = tl.with_dim_map(tdm, None)
            if a.is_dt("weight"):
                res["weight"] = a.layout["weight"].replicated()
            return res, used
        cands = [make({t: xl.dim_map[t] for t in batch})]
        if tl is not None and len(ts) == (n if prob_target else n - 1):
            cands.append(make({t: tl.dim_map[t_of(t)] for t in batch}))
        tgt, used = min(cands, key=lambda c: a.cost(c[0]))
        bdm = {t: tgt["input"].dim_map[t] for t in batch}
        if reduction == "none":
            out_dm = [bdm[t] for t in batch]
            out = xl.with_dim_map(out_dm, None)
            return Strategy(a.targets(tgt), out)
        if not used:
            return Strategy(a.targets(tgt), xl.with_dim_map((), None))
        partial = [None] * xl.mesh_ndim
        for d in used:
            partial[d] = "sum"
        out = xl.with_dim_map((), partial)
        local_fn = None
        if reduction == "mean":
            count = 1
            for t in batch:
                count *= xs[t]
            groups = [call.mesh.get_comm_group(d) for d in used if call.mesh.size(d) > 1]
            local_fn = _mean_loss_fn(call.name, self.names, prob_target, count, groups)
        elif reduction == "sum":
            local_fn = _sum_loss_fn(call.name, self.names)
        else:
            raise ValueError(f"{call.name}: {reduction} is not a valid value for reduction")
        return Strategy(a.targets(tgt), out, local_fn=local_fn, out_shapes=torch.Size(()))


def _loss_sum(name, bound):
    F = torch.nn.functional
    x, t, w = bound["input"], bound["target"], bound.get("weight")
    ii = bound.get("ignore_index", -100)
    if name == "cross_entropy":
        return F.cross_entropy(x, t, w, None, ii, None, "sum", bound.get("label_smoothing", 0.0))
    return F.nll_loss(x, t, w, None, ii, None, "sum")


def _sum_loss_fn(name, names):
    def fn(*args, **kwargs):
        return _loss_sum(name, _bind(args, kwargs, names))
    return fn


def _mean_loss_fn(name, names, prob_target, static_count, groups):
    ops, coll = torch, collectives

    def fn(*args, **kwargs):
        v = _bind(args, kwargs, names)
        s = _loss_sum(name, v)
        if prob_target:
            return s / static_count
        t, w = v["target"], v.get("weight")
        ii = v.get("ignore_index", -100)
        with ops.no_grad():
            valid = t != ii
            if w is None:
                denom = valid.sum().to(s.dtype)
            else:
                denom = w.detach().gather(0, t[valid].flatten()).sum().to(s.dtype)
            for g in groups:
                denom = coll.all_reduce(denom, g, "sum")
        return s / denom
    return fn


# ----------------------------------------------------------------------------- attention
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class SDPARule(DistributedOp):
    """scaled_dot_product_attention(q[..., L, E], k[..., S, E], v[..., S, Ev], attn_mask[..., L, S]).

    Batch and head dims (everything but the last two) keep their shards - q, k,
    v and the mask agree; sequence and feature dims are unsharded.
    """

    float_args_matter = True  # dropout_p is baked into the local function

    def strategy(self, call):
        a = _Args(call, _SDPA_NAMES)
        dropout_p = a.get("dropout_p", 0.0)
        dropout_p = float(dropout_p or 0.0)
        if not 0.0 <= dropout_p <= 1.0:
            raise ValueError(f"scaled_dot_product_attention: dropout_p must be between 0 and 1, got {dropout_p}")
        qkv = ("query", "key", "value")
        if not all(a.is_dt(r) for r in qkv):
            raise NotImplementedError("scaled_dot_product_attention: query, key and value must all be DTensors")
        nb = len(a.shape["query"]) - 2
        roles = [r for r in ("query", "key", "value", "attn_mask") if a.is_dt(r)]

        def cand(src):
            lay, shp = a.layout[src], a.shape[src]
            off = len(shp) - 2 - nb
            dm = [lay.dim_map[off + j] if off + j >= 0 else () for j in range(nb)]
            # each batch dim: operands of the reference size share the shard, size-1 (broadcast) ones don't
            ref = [max(a.shape[r][len(a.shape[r]) - 2 - nb + j] if len(a.shape[r]) - 2 - nb + j >= 0 else 1
                       for r in roles) for j in range(nb)]
            tg = {}
            for j in range(nb):
                if not dm[j]:
                    continue
                k = 1
                for d in dm[j]:
                    k *= lay.mesh_shape[d]
                sizes = [a.shape[r][len(a.shape[r]) - 2 - nb + j] for r in roles
                         if len(a.shape[r]) - 2 - nb + j >= 0]
                odd = [s for s in sizes if s not in (1, ref[j])]
                if odd and any(s % k for s in sizes if s != 1):
                    dm[j] = ()  # grouped heads (GQA) shard consistently only when evenly divisible
            for r in roles:
                lr, sr = a.layout[r], a.shape[r]
                o = len(sr) - 2 - nb
                rdm = [()] * len(sr)
                for j in range(nb):
                    # a size-1 dim broadcasts against larger operands; when every operand has size 1 there
                    # it is the real extent and keeps the shard (the output is sharded on it)
                    if o + j >= 0 and (sr[o + j] != 1 or ref[j] == 1):
                        rdm[o + j] = dm[j]
                tg[r] = lr.with_dim_map(rdm, None)
            return tg, dm
        cands = [cand(r) for r in qkv]
        cands = [(tg, dm, ()) for tg, dm in cands] + _seq_sharded_cands(a, cands, nb)
        # cheapest; on a tie the sequence-sharded candidate (less work per rank, no gather later)
        tg, dm, seq = min(cands, key=lambda c: (a.cost(c[0]), 0 if c[2] else 1))
        ql = a.layout["query"]
        out = ql.with_dim_map(tuple(dm) + (seq, ()), None)
        if dropout_p > 0.0:
            from hyper_parallel.dispatch.rules.attention_dropout import sdpa_dropout_strategy
            return sdpa_dropout_strategy(call, a.targets(tg), out, a.shape, dropout_p)
        if not seq:
            return Strategy(a.targets(tg), out, local_fn=_sdpa_local)
        qshape = a.shape["query"]
        _, off = tg["query"].local_shape_and_offset(qshape, coord=call.mesh.get_coordinate())
        return Strategy(a.targets(tg), out, local_fn=_seq_sharded_sdpa(off[len(qshape) - 2]))


def _seq_sharded_cands(attn_args, cands, batch_dims):
    """Candidates keeping the query's sequence shard (K/V whole on every rank): no gather of q.

    Each rank attends its own query rows to all keys; the output keeps the
    sequence shard. An ``attn_mask`` with a query-length dim is sharded alike;
    ``is_causal`` becomes an explicit mask at the rows' global offset.
    """
    ql, qshape = attn_args.layout["query"], attn_args.shape["query"]
    ld = len(qshape) - 2
    seq = ql.dim_map[ld]
    if not seq:
        return []
    out = []
    for tg, dm in cands:
        used = {d for m in dm for d in m}
        if used & set(seq):
            continue
        tg = dict(tg)
        q_dm = list(tg["query"].dim_map)
        q_dm[ld] = seq
        tg["query"] = tg["query"].with_dim_map(q_dm, None)
        if "attn_mask" in tg:
            ms = attn_args.shape["attn_mask"]
            if len(ms) >= 2 and ms[-2] == qshape[-2] and ms[-2] != 1:
                m_dm = list(tg["attn_mask"].dim_map)
                m_dm[len(ms) - 2] = seq
                tg["attn_mask"] = tg["attn_mask"].with_dim_map(m_dm, None)
            # (a mask broadcast over the query rows serves every rank's rows as it is)
        out.append((tg, dm, seq))
    return out


def _seq_sharded_sdpa(row_offset: int):
    """SDPA on this rank's query rows, which start at global row ``row_offset``."""
    ops = torch

    def fn(*args, **kwargs):
        v = _bind(args, kwargs, _SDPA_NAMES)
        q, k, val = v["query"], v["key"], v["value"]
        mask, causal = v.get("attn_mask"), bool(v.get("is_causal", False))
        if causal:
            if mask is not None:
                raise RuntimeError("scaled_dot_product_attention: attn_mask and is_causal=True cannot both be set")
            rows = ops.arange(row_offset, row_offset + q.shape[-2], device=q.device).unsqueeze(-1)
            mask = ops.arange(k.shape[-2], device=q.device).unsqueeze(0) <= rows
        kw = {"attn_mask": mask, "dropout_p": v.get("dropout_p", 0.0), "is_causal": False, "scale": v.get("scale")}
        if v.get("enable_gqa"):
            kw["enable_gqa"] = True
        return _sdpa_local(q, k, val, **kw)
    return fn


def _sdpa_local(*args, **kwargs):
    out = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
    if out.numel() == 0:
        # empty shard (uneven batch/heads): torch leaves a float attn_mask without a gradient; keep every
        # input connected so that its local gradient is an (empty) tensor as on the other ranks
        for x in list(args) + list(kwargs.values()):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                out = out + x.sum() * 0
    return out


def _normalize(input, p=2.0, dim=1, eps=1e-12, out=None):  # noqa: A002 - torch's argument names
    """``F.normalize`` on DTensors: torch's own formula, each op dispatched (the norm over a sharded dim
    is an all_reduce of powered sums, the division keeps the input's shards)."""
    if out is not None:
        raise NotImplementedError("normalize on DTensors: out= is not supported")
    denom = input.norm(p, dim, keepdim=True).clamp_min(eps).expand_as(input)
    return input / denom


# ----------------------------------------------------------------------------- registration
def register_all():
    for n in ("softmax", "log_softmax", "softmin"):
        SoftmaxRule(n)
    ScanRule("cumsum", linear=True)
    ScanRule("cumsum_", linear=True)
    ScanRule("cumprod")
    ScanRule("cumprod_")
    ScanRule("logcumsumexp")
    ScanRule("cummax", n_out=2)
    ScanRule("cummin", n_out=2)
    NormRule("layer_norm", ("input", "normalized_shape", "weight", "bias", "eps"))
    NormRule("rms_norm", ("input", "normalized_shape", "weight", "eps"))
    EmbeddingRule("embedding")
    DropoutRule("dropout")
    ClassLossRule("cross_entropy", _CE_NAMES)
    ClassLossRule("nll_loss", _NLL_NAMES)
    SDPARule("scaled_dot_product_attention")
    PLAIN_AS_REPLICATED.add("scaled_dot_product_attention")  # a plain attn_mask is a replicated one
    register_decomposition(torch.nn.functional.normalize, _normalize)


__all__ = ["register_all", "SoftmaxRule", "ScanRule", "NormRule", "EmbeddingRule", "DropoutRule", "ClassLossRule",
           "SDPARule"]
