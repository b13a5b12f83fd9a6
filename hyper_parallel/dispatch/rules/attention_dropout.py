"""``scaled_dot_product_attention(..., dropout_p > 0)`` on DTensors: a layout-independent attention dropout.

Definition (what every layout computes, and what one process computes with
:func:`sdpa_dropout_reference`): for query ``q[*B, L, E]``, key ``k[*B, S, E]``,
value ``v[*B, S, Ev]``

    scores = q @ k^T * scale                     (scale = 1 / sqrt(E) unless given)
    scores += attn_mask (float)  |  scores[~attn_mask] = -inf (bool)  |  causal: scores[j > i] = -inf
    w = softmax(scores, -1)
    out = (w * keep / (1 - p)) @ v               (p = 1: zeros)

with ``keep = u >= p``, ``u`` the DTensor random stream's uniform float32 matrix
of shape ``(prod(B) * L, S)`` (row ``flat(b) * L + i`` holds query row ``i`` of
batch/head entry ``b``) - one call of the stream per attention call. Each rank
draws only the rows of its own batch, head and query-row shard, so the mask does
not depend on the mesh or the sharding of batch, heads or the query sequence,
and the gradients use the same mask. ``enable_gqa`` repeats each key/value head
for its group of query heads.

torch's own CPU kernel draws its mask with ``bernoulli_(1 - p)`` over the whole
attention matrix from the process generator; a rank cannot draw its part of that
stream without drawing all of it, so DTensor attention uses the rule above for
every layout, replicated included (the other random ops follow torch on
replicated inputs, see ``random_ops.py``).
"""
from __future__ import annotations

import itertools
import math

from hyper_parallel.dtensor import random as dt_random
from hyper_parallel.dispatch.rules.base import Strategy
from hyper_parallel.dispatch.rules.base import bind_args as _bind
import torch

_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _row_ranges(bshape, rows_per_batch, loc_b, off_b, l_off, l_len):
    """Row ranges of the ``(prod(bshape) * L, S)`` matrix held locally, merged where contiguous."""
    ranges = []
    for idx in itertools.product(*[range(o, o + n) for o, n in zip(off_b, loc_b)]):
        flat = 0
        for i, s in zip(idx, bshape):
            flat = flat * s + i
        a = flat * rows_per_batch + l_off
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], a + l_len)
        else:
            ranges.append((a, a + l_len))
    return ranges


def _keep_scale(uniform, dropout_p, dtype):
    if dropout_p >= 1.0:
        return (uniform * 0).to(dtype)
    return (uniform >= dropout_p).to(dtype) * (1.0 / (1.0 - dropout_p))


def _attend(query, key, value, mask, causal, scale, gqa, keep_scaled, row_offset):
    ops = torch
    if gqa and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(rep, dim=-3)
        value = value.repeat_interleave(rep, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if causal:
        if mask is not None:
            raise RuntimeError("scaled_dot_product_attention: attn_mask and is_causal=True cannot both be set")
        rows = ops.arange(row_offset, row_offset + query.shape[-2], device=query.device).unsqueeze(-1)
        allowed = ops.arange(key.shape[-2], device=query.device).unsqueeze(0) <= rows
        scores = scores.masked_fill(~allowed, float("-inf"))
    elif mask is not None:
        if mask.dtype == ops.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    w = torch.nn.functional.softmax(scores, dim=-1)
    return (w * keep_scaled) @ value


def _check_shapes(shapes):
    q = shapes["query"]
    nb = len(q) - 2
    for r in ("key", "value"):
        s = shapes[r]
        if len(s) - 2 > nb:
            raise NotImplementedError(
                f"scaled_dot_product_attention with dropout_p > 0 on DTensors: {r} has more batch dims "
                f"({tuple(s)}) than the query ({tuple(q)}); the attention matrix must have the query's batch dims")


def sdpa_dropout_strategy(call, in_targets, out, shapes, dropout_p):
    """The SDPA strategy's layouts with a local function that applies the layout-independent dropout."""
    _check_shapes(shapes)
    qshape, S = tuple(shapes["query"]), shapes["key"][-2]
    bshape, L = qshape[:-2], qshape[-2]
    attn_shape = bshape + (L, S)
    lshape, off = out.local_shape_and_offset(attn_shape, coord=call.mesh.get_coordinate())
    nb = len(bshape)
    ranges = _row_ranges(bshape, L, lshape[:nb], off[:nb], off[nb], lshape[nb])
    n_rows = L
    for s in bshape:
        n_rows *= s
    row_offset = off[nb]
    ops = torch

    def local_fn(*args, **kwargs):
        v = _bind(args, kwargs, _SDPA_NAMES)
        q = v["query"]
        u = dt_random.random_rows("rand", n_rows, S, ranges, ops.float32, q.device).reshape(lshape)
        keep = _keep_scale(u, dropout_p, q.dtype)
        return _attend(q, v["key"], v["value"], v.get("attn_mask"), bool(v.get("is_causal", False)),
                       v.get("scale"), bool(v.get("enable_gqa", False)), keep, row_offset)
    return Strategy(in_targets, out, local_fn=local_fn, out_shapes=torch.Size(qshape[:-1] + (shapes["value"][-1],)))


def sdpa_dropout_reference(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                           enable_gqa=False):
    """The same attention dropout on plain tensors in one process (the stream's next call draws the mask).

    ``hyper_parallel.manual_seed(s)`` followed by this function gives what a DTensor
    ``scaled_dot_product_attention(..., dropout_p=p)`` gives after the same seed,
    for every mesh and sharding.
    """
    if not 0.0 <= float(dropout_p) <= 1.0:
        raise ValueError(f"sdpa_dropout_reference: dropout_p must be between 0 and 1, got {dropout_p}")
    ops = torch
    bshape, L, S = tuple(query.shape[:-2]), query.shape[-2], key.shape[-2]
    n = L
    for s in bshape:
        n *= s
    u = dt_random.random_rows("rand", n, S, [(0, n)], ops.float32, query.device).reshape(bshape + (L, S))
    keep = _keep_scale(u, float(dropout_p), query.dtype)
    return _attend(query, key, value, attn_mask, is_causal, scale, enable_gqa, keep, 0)


__all__ = ["sdpa_dropout_strategy", "sdpa_dropout_reference"]
