"""HyperParallel's own error messages for the calls strict layouts refuse (issue 33, item 3).

The core reaches these through the registered HyperParallel semantics (``semantics.py`` beside this
file: ``strict_message`` / ``strict_semantic``), never by importing this module.

HyperParallel's shard-op rules (``hyper_parallel/core/shard/ops/parallel_*.py`` in
mindspore-ai/hyper-parallel) raise from their layout inference, and its tests assert the exception
type **and** a substring of the message. Under strict layouts (``dispatch/strict_layouts.py``) our error starts
with the message HyperParallel's rule raises for that call, word for word (the fixed text of its
``raise`` statement with the same values: its op name, the dim as its rule normalises it, its
``tensor_map`` / ``alias_tensor_map`` spellings and its layout dump), then our own detail (the
tensor dim, the mesh dim, both layouts and the fix).

:func:`message` answers ``(exception class, text)`` for the first check HyperParallel's rule would
fail on these inputs, in its rule's order, or None (the call is refused for a reason its rule does
not check; our text alone is raised). :func:`semantic` is the strict-mode check for the two rules
that refuse inputs no redistribution is implicit for (a replicated operand next to a sharded
one, which our rules slice locally): SDPA with K/V (or Q/K) sharding that differs, and scatter with
an index/src laid out unlike the input.

A ``tensor_map`` entry is the mesh dim counted from the right (``-1``: not sharded), HyperParallel's
convention, which ``Layout.tensor_map`` also follows here.
"""
from __future__ import annotations

_NIE = NotImplementedError


# ----------------------------------------------------------------------------- helpers
def _arg(args, kwargs, pos, name, default=None):
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


def _norm(dim, ndim):
    return dim + ndim if isinstance(dim, int) and dim < 0 else dim


def _lay(dtensor):
    return dtensor._layout


def _sharded(entry):
    """A tensor_map entry that is not ``-1`` (HyperParallel: sharded, whatever the mesh dim's size)."""
    if isinstance(entry, (tuple, list)):
        return any(m != -1 for m in entry)
    return entry != -1


def _hp_dump(layout):
    """HyperParallel's ``Layout.to_string()`` dump of ``layout``."""
    names = tuple(layout.alias_names)
    n = len(names)
    readable = []
    for item in layout.tensor_map:
        if isinstance(item, tuple):
            readable.append(tuple(names[n - 1 - m] if m != -1 else "None" for m in item))
        else:
            readable.append(names[n - 1 - item] if item != -1 else "None")
    partial = [None if p is None else getattr(p, "reduce_op", p) for p in layout.partial]
    interleaved = "Yes" if "interleaved_parallel" in names else "No"
    return (f"Layout Configuration:\n"
            f"  Mesh shape: {tuple(layout.mesh_shape)}\n"
            f"  Alias Names: {names}\n"
            f"  Partial: {partial}\n"
            f"  Tensor Map: {tuple(readable)}\n"
            f"  Interleaved Parallel: {interleaved}\n"
            f"  Rank List: {tuple(layout.rank_list)}")


def _first(dts, args, kwargs=None, pos=0, name="input"):
    """The DTensor passed at ``args[pos]`` (or as keyword ``name``), else None."""
    a = _arg(args, kwargs or {}, pos, name)
    return a if any(a is d for d in dts) else None


# ----------------------------------------------------------------------------- the rules
def _softmax(name, dts, args, kwargs):
    # ActivationWithAxisDistributedOp.check_layout
    x = _first(dts, args, kwargs)
    dim = _arg(args, kwargs, 1, "dim")
    if x is None or not isinstance(dim, int):
        return None
    lay = _lay(x)
    tm, shape = lay.tensor_map, tuple(lay.mesh_shape)
    entry = tm[dim]
    if entry == -1:
        return None
    entries = entry if isinstance(entry, tuple) else (entry,)
    strategy = 1
    for m in entries:
        strategy *= shape[len(shape) - m - 1]
    if strategy == 1:
        return None
    return ValueError, (f"Operation {name}: The axis dimension (in dim {dim}) is sharded "
                        f"(strategy is {strategy}). This operation requires the reduction axis to be un-sharded.")


def _normalized_dim(name, dims, tensor_map):
    # CumsumDistributedOp / LayerNormDistributedOp
    for d in dims:
        if tensor_map[d] != -1:
            return ValueError, (f"Operation {name}: Cannot perform sharding on normalized dimension {d}, "
                                f"but found sharding assignment: {tensor_map[d]}")
    return None


def _cumsum(name, dts, args, kwargs):
    x = _first(dts, args, kwargs)
    dim = _arg(args, kwargs, 1, "dim")
    if x is None or not isinstance(dim, int):
        return None
    tm = _lay(x).tensor_map
    return _normalized_dim(name, [_norm(dim, len(tm))], tm)


def _layer_norm(name, dts, args, kwargs):
    x = _first(dts, args, kwargs)
    shape = _arg(args, kwargs, 1, "normalized_shape")
    if x is None or shape is None:
        return None
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    tm = _lay(x).tensor_map
    return _normalized_dim(name, range(len(tm) - len(shape), len(tm)), tm)


def _sort(name, dts, args, kwargs):
    x = _first(dts, args, kwargs)
    dim = _arg(args, kwargs, 1, "dim", -1)
    if x is None or not isinstance(dim, int):
        return None
    tm = _lay(x).tensor_map
    dim = _norm(dim, len(tm))
    mapping = tm[dim]
    if not _sharded(mapping):
        return None
    return ValueError, (f"For 'sort', sorting along a sharded dimension (dim {dim} mapped to {mapping}) is not "
                        f"supported. Please redistribute the tensor to Replicate status on this dimension before "
                        f"sorting.")


def _chosen_dim(name, dts, args, kwargs, pos, default):
    # TopKDistributedOp / RepeatInterleaveDistributedOp
    x = _first(dts, args, kwargs)
    dim = _arg(args, kwargs, pos, "dim", default)
    if x is None or not isinstance(dim, int):
        return None
    tm = _lay(x).tensor_map
    if tm[_norm(dim, len(tm))] == -1:
        return None
    return ValueError, f"Operation {name}: Cannot perform sharding on params along the chosen dim"


def _topk(name, dts, args, kwargs):
    return _chosen_dim(name, dts, args, kwargs, 2, -1)


def _repeat_interleave(name, dts, args, kwargs):
    x = _first(dts, args, kwargs)
    dim = _arg(args, kwargs, 2, "dim")
    if x is None:
        return None
    if dim is None:
        tm = _lay(x).tensor_map
        sharded = [i for i, e in enumerate(tm) if e != -1]
        if sharded and sharded != [0]:
            return ValueError, f"Operation {name}: Cannot flatten tensor when dim=None."
        return None
    return _chosen_dim(name, dts, args, kwargs, 2, None)


def _unbind(name, dts, args, kwargs):
    x = _first(dts, args, kwargs)
    dim = _arg(args, kwargs, 1, "dim", 0)
    if x is None or not isinstance(dim, int):
        return None
    tm = _lay(x).tensor_map
    dim = _norm(dim, len(tm))
    if tm[dim] == -1:
        return None
    return ValueError, (f"For 'unbind', the dimension {dim} is sharded (mapped to mesh axis {tm[dim]}). "
                        f"Unbinding a sharded dimension is not supported. "
                        f"Please redistribute the tensor to replicate this dimension first.")


def _split(name, dts, args, kwargs):
    x = _first(dts, args, kwargs)
    axis = _arg(args, kwargs, 2, "dim", 0)
    if x is None or not isinstance(axis, int):
        return None
    lay = _lay(x)
    axis = _norm(axis, len(lay.tensor_map))
    if lay.tensor_map[axis] == -1:
        return None
    return ValueError, f"Can not split tensor at sharded axis[{axis}], layout: {_hp_dump(lay)}"


def _expand(name, dts, args, kwargs):
    x = _first(dts, args, kwargs)
    if x is None:
        return None
    if len(args) > 1:
        sizes = args[1:]
        if len(sizes) == 1 and not isinstance(sizes[0], int):   # x.expand((8, 16)) / x.expand(torch.Size(...))
            sizes = sizes[0]
    else:
        sizes = kwargs.get("size", ())
    sizes = tuple(int(s) for s in sizes)
    tm = _lay(x).tensor_map
    new = len(sizes) - len(tm)
    if new < 0:
        return None
    for i, e in enumerate(tm):
        if sizes[new + i] != -1 and e != -1:
            return ValueError, f"Operation {name}: Cannot expand dimension {i} which is sharded."
    return None


def _pad(name, dts, args, kwargs):
    x = _first(dts, args, kwargs)
    pad = _arg(args, kwargs, 1, "pad")
    if x is None or not isinstance(pad, (tuple, list)) or len(pad) % 2:
        return None
    alias = _lay(x).alias_tensor_map
    ndim = len(alias)
    for i in range(min(len(pad) // 2, ndim)):
        dim_index = ndim - 1 - i
        if pad[2 * i] != 0 or pad[2 * i + 1] != 0:
            axis_alias = alias[dim_index]
            if (any(a != "None" for a in axis_alias) if isinstance(axis_alias, (tuple, list))
                    else axis_alias != "None"):
                return ValueError, (f"Distributed Pad operator does not support padding on a sharded dimension. "
                                    f"Dimension {dim_index} (alias: {axis_alias}) is sharded. "
                                    f"Please redistribute the tensor to Replicate status on this dimension before "
                                    f"padding.")
    return None


def _scatter(name, dts, args, kwargs):
    x = _first(dts, args, kwargs)
    dim = _arg(args, kwargs, 1, "dim")
    if x is None or not isinstance(dim, int):
        return None
    input_map = _lay(x).tensor_map
    dim = _norm(dim, len(input_map))
    if input_map[dim] != -1:
        return ValueError, (f"Operation {name}: Scatter along sharded dimension {dim} is not supported. "
                            "The target dimension must be Replicated (unsharded).")
    for pos, key, what in ((2, "index", "Index"), (3, "src", "Src")):
        t = _arg(args, kwargs, pos, key)
        if t is None and key == "src":
            t = kwargs.get("value")
        if any(t is d for d in dts) and _lay(t).tensor_map != input_map:
            return ValueError, (f"Operation {name}: {what} tensor layout {_lay(t).tensor_map} "
                                f"must match input tensor layout {input_map}.")
    return None


def _masked_scatter(name, dts, args, kwargs):
    ins = [_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "mask"), _arg(args, kwargs, 2, "source")]
    for i, t in enumerate(ins):
        if not any(t is d for d in dts):
            continue
        lay = _lay(t)
        if any(e != -1 for e in lay.tensor_map):
            return ValueError, (f"Operation {name}: Input {i} (Layout: {_hp_dump(lay)}) is sharded. "
                                f"masked_scatter currently only supports fully Replicated (Unsharded) tensors "
                                f"due to sequential dependency on source elements.")
    return None


def _multinomial(name, dts, args, kwargs):
    x = _first(dts, args, kwargs)
    if x is None:
        return None
    alias = _lay(x).alias_tensor_map
    if len(alias) not in (1, 2) or alias[-1] == "None":
        return None
    return ValueError, (f"For 'multinomial', the last dimension (probability category dimension) "
                        f"must not be sharded (Replicated). Got layout map: {alias}. "
                        f"Please redistribute the tensor to replicate the last dimension before calling multinomial.")


def _isin(name, dts, args, kwargs):
    t = _arg(args, kwargs, 1, "test_elements")
    if not any(t is d for d in dts):
        return None
    tm = _lay(t).tensor_map
    if all(e == -1 for e in tm):
        return None
    return ValueError, f"Operation {name}: 'test_elements' must be unsharded. Current tensor_map: {tm}."


def _squeeze(name, dts, args, kwargs):
    x = _first(dts, args, kwargs)
    axis = _arg(args, kwargs, 1, "dim")
    if x is None or axis is None:
        return None
    lay = _lay(x)
    alias, shape = lay.alias_tensor_map, tuple(x._gshape)
    axes = [axis] if isinstance(axis, int) else list(axis)
    for ax in (a if a >= 0 else a + len(alias) for a in axes):
        if not 0 <= ax < len(alias):
            return None
        if shape[ax] != 1:
            return ValueError, (f"For {name}, dimension should have size 1, "
                                f"but got shape {shape[ax]} at dimension {ax}.")
        if alias[ax] != "None":
            return ValueError, (f"For {name}, dimension should not be distributed, "
                                f"but got dimension {ax} mapped to device axis {alias[ax]}.")
    return None


def _split_num(lay, idx):
    """Devices along tensor dim ``idx`` (HyperParallel's ``_get_dim_split_num``)."""
    if idx >= len(lay.dim_map):
        return 1
    n = 1
    for m in lay.dim_map[idx]:
        n *= lay.mesh_shape[m]
    return n


def _sdpa(name, dts, args, kwargs):
    # ScaledDotProductAttentionDistributedOp: get_expand_impl, then the checks of its expanded impl
    q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
    q = q if any(q is d for d in dts) else None
    k = k if any(k is d for d in dts) else None
    v = v if any(v is d for d in dts) else None
    if q is None:
        return None
    if k is not None and v is not None and _lay(k).tensor_map != _lay(v).tensor_map:
        return ValueError, (f"Key and Value must have identical sharding strategies.\n"
                            f"Key tensor_map: {_lay(k).tensor_map}\n"
                            f"Value tensor_map: {_lay(v).tensor_map}")
    q_tm = _lay(q).tensor_map
    dims = {"head": 0, "seq": 1, "dim": 2} if len(q_tm) == 3 else {"batch": 0, "head": 1, "seq": 2, "dim": 3}
    if k is not None:
        k_tm = _lay(k).tensor_map
        for dim_name in ("batch", "head", "dim"):
            if dim_name not in dims:
                continue
            idx = dims[dim_name]
            if idx >= len(q_tm) or idx >= len(k_tm):
                continue
            if q_tm[idx] != k_tm[idx]:
                return ValueError, (f"Query and Key/Value must have identical {dim_name} "
                                    f"sharding strategy.\n"
                                    f"Query {dim_name} sharding (dim {idx}): {q_tm[idx]}\n"
                                    f"Key/Value {dim_name} sharding (dim {idx}): {k_tm[idx]}\n"
                                    f"Query tensor_map: {q_tm}\n"
                                    f"Key tensor_map: {k_tm}")
    seq = _split_num(_lay(q), dims["seq"])
    if seq > 1 and k is not None:
        kv_seq = _split_num(_lay(k), dims["seq"])
        if kv_seq > 1:
            return _NIE, ("KV sequence sharding is not supported for SDPA "
                          "without Ring Attention.\n"
                          f"Query sequence split num: {seq}\n"
                          f"Key/Value sequence split num: {kv_seq}")
    return None


# op name (ours = HyperParallel's registry key) -> the rule's first failing check
RULES = {
    "softmax": _softmax,
    "cumsum": _cumsum,
    "sort": _sort,
    "topk": _topk,
    "unbind": _unbind,
    "split": _split,
    "layer_norm": _layer_norm,
    "expand": _expand,
    "pad": _pad,
    "scatter": _scatter,
    "masked_scatter": _masked_scatter,
    "multinomial": _multinomial,
    "isin": _isin,
    "scaled_dot_product_attention": _sdpa,
    "squeeze": _squeeze,
    "repeat_interleave": _repeat_interleave,
}


def message(name, dts, args, kwargs):
    """``(exception class, HyperParallel's message)`` for this call, or None (see the module docstring)."""
    rule = RULES.get(name)
    if rule is None:
        return None
    try:
        return rule(name, dts, args, kwargs)
    except (TypeError, ValueError, IndexError, AttributeError):  # an argument form the rule does not read
        return None


def semantic(name, dts, args, kwargs):
    """HyperParallel's refusal of a call that needs no implicit gather: SDPA Q/K/V and scatter index/src layouts.

    ``(exception class, HyperParallel's message)`` or None. Only the layout-agreement checks count here
    (the others are refusals of an implicit redistribution, which ``dispatch/strict_layouts.py`` finds itself).
    """
    if name not in ("scaled_dot_product_attention", "scatter"):
        return None
    found = message(name, dts, args, kwargs)
    if found is None:
        return None
    text = found[1]
    if text.startswith(("Key and Value must", "Query and Key/Value must")) or " tensor layout " in text:
        return found
    return None


__all__ = ["message", "semantic", "RULES"]
