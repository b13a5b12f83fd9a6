"""Strict layouts: which redistributions count as implicit, and the errors / warnings for them.

The dispatcher (``_op_dispatch.OpDispatcher._build``) calls :func:`violation` once
per cache entry; the result (``None`` for almost every entry) is stored on the
entry and :func:`enforce` runs only when strict or warn-only mode is on.

**Implicit** (what strict mode refuses): redistributing an input so that a
tensor dim that is sharded on a mesh dim of size > 1 is gathered (unsharded) or
moved to another tensor dim, i.e. the mesh dims sharding tensor dim ``t`` in the
input's layout are not a prefix of those sharding ``t`` in the target layout.
Not implicit: a local split (``Replicate -> Shard``, no communication), a
``Replicate -> Partial`` conversion, and the reduction of a ``Partial`` input
(``all_reduce`` / ``reduce_scatter``: the pending reduction every consumer of a
partial value needs). Collectives an op's own rule runs as part of its
computation (a norm's all_reduce, ``equal``'s answer) are not redistributions.

Semantic cases without any redistribution are also refused, as HyperParallel
does: ``squeeze(dim)`` of a dim whose global size is not 1 (PyTorch: a no-op), SDPA
whose K and V (or Q and K on the batch/head/embedding dims) are laid out differently,
and ``scatter`` whose index or src is laid out unlike the input (our rules slice a
replicated operand locally there).

Every message starts with HyperParallel's own message for that call, word for word, then ours.
HyperParallel's messages (and its SDPA/scatter layout-agreement refusals) come from its registered
semantics (``dtensor/mesh_semantics.hyperparallel()``: ``strict_message`` / ``strict_semantic``, whose
code is in ``compat/hyperparallel/strict_messages.py``); they apply on every mesh.
"""
from __future__ import annotations

import warnings

from hyper_parallel.dispatch import modes as _modes
from hyper_parallel.dtensor import mesh_semantics as _mesh_semantics


def _hp_message(name, dts, args, kwargs):
    """HyperParallel's ``(exception class, message)`` for this refused call, or None."""
    hp = _mesh_semantics.hyperparallel()
    return None if hp is None else hp.strict_message(name, dts, args, kwargs)


def _hp_semantic(name, dts, args, kwargs):
    """HyperParallel's refusal of operands laid out unlike each other (SDPA, scatter), or None."""
    hp = _mesh_semantics.hyperparallel()
    return None if hp is None else hp.strict_semantic(name, dts, args, kwargs)


_WARNED = _modes.STRICT_WARNED  # (op, layouts) warned about; cleared by modes._reset
_SDPA = "scaled_dot_product_attention"


def _placements_text(layout):
    return "[" + ", ".join(str(p) for p in layout.placements) + "]"


def _kept(dims, mesh_shape):
    return tuple(m for m in dims if mesh_shape[m] > 1)


def _dim_changes(src, tgt):
    """[(tensor dim, description)] for the sharded dims of ``src`` that ``tgt`` gathers or moves."""
    shape = src.mesh_shape
    out = []
    for t, dims in enumerate(src.dim_map):
        s = _kept(dims, shape)
        g = _kept(tgt.dim_map[t], shape)
        if not s or g[:len(s)] == s:
            continue
        what = []
        for m in s:
            if m in g:
                continue
            u = tgt.tensor_dim_of(m)
            name = src.alias_names[m]
            what.append(f"gathered over mesh dim '{name}'" if u is None else
                        f"moved from mesh dim '{name}' to dim {u}")
        if not what:  # same mesh dims, other order
            what.append(f"re-ordered over mesh dims {[src.alias_names[m] for m in g]}")
        out.append((t, ", ".join(what)))
    return out


def _is_ring_attention(name, arg_index, tensor_dim, ndim):
    """HyperParallel's NotImplementedError cases of SDPA: K/V sequence sharding, last (embedding) dim sharding."""
    return name == _SDPA and ((arg_index in (1, 2) and tensor_dim == ndim - 2) or tensor_dim == ndim - 1)


def violation(name, dts, redist, args, kwargs):
    """``(exception class, message, moves, name)`` when ``name`` would break strict layouts, else None.

    ``redist[i]`` is the target layout of DTensor input ``i`` (None: unchanged);
    ``moves`` are ``(i, target layout)`` of the implicit redistributions (for their bytes).
    """
    parts, moves, cls = [], [], _modes.StrictLayoutError
    for i, (d, tl) in enumerate(zip(dts, redist)):
        if tl is None:
            continue
        changes = _dim_changes(d._layout, tl)
        if not changes:
            continue
        moves.append((i, tl))
        for t, what in changes:
            parts.append(f"input {i} dim {t} ({what}: {_placements_text(d._layout)} -> {_placements_text(tl)})")
            if _is_ring_attention(name, i, t, len(d._gshape)):
                cls = _modes.StrictLayoutNotImplementedError
    if parts:
        got = ", ".join(f"input {i}: {_placements_text(d._layout)}" for i, d in enumerate(dts))
        msg = (f"strict layouts: {name} would redistribute implicitly {'; '.join(parts)} "
               f"(inputs: {got}). Fix: call .redistribute(mesh, placements) on those inputs yourself (or create "
               "them with matching placements), or leave strict mode (hyper_parallel.strict_layouts(False), "
               "also spelt set_strict_layouts(False))")
        if cls is _modes.StrictLayoutNotImplementedError:
            msg += ("; HyperParallel supports neither K/V sequence sharding (ring attention) nor a sharded "
                    "last (embedding) dim here")
        hp = _hp_message(name, dts, args, kwargs)   # HyperParallel's own message first (issue 33)
        if hp is not None:
            if hp[0] is NotImplementedError:
                cls = _modes.StrictLayoutNotImplementedError
            msg = _join(hp[1], msg)
        return cls, msg, tuple(moves), name
    check = _SEMANTIC.get(name)
    return check(name, dts, args, kwargs) if check is not None else None


def _join(hp_text, ours):
    """HyperParallel's message, word for word, then ours (the layouts, the mesh dim, the fix)."""
    return f"{hp_text}\n{ours}"


def _squeeze(name, dts, args, kwargs):
    if not args or args[0] is not dts[0]:
        return None
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if dim is None:
        return None
    shape = tuple(dts[0]._gshape)
    dims = dim if isinstance(dim, (list, tuple)) else (dim,)
    bad = [d for d in dims if isinstance(d, int) and -len(shape) <= d < len(shape) and shape[d] != 1]
    if not bad:
        return None
    lay = dts[0]._layout
    hp = _hp_message(name, dts, args, kwargs)
    msg = (f"strict layouts: {name} of dim {bad[0] % len(shape)} of size {shape[bad[0]]} (global shape {shape}, "
           f"layout {_placements_text(lay)}): the dim is not a singleton, so PyTorch keeps it (a no-op) and HyperParallel "
           "raises. Fix: squeeze only size-1 dims, or leave strict mode (hyper_parallel.strict_layouts(False))")
    return _modes.StrictLayoutError, (msg if hp is None else _join(hp[1], msg)), (), name


def _layouts_agree(name, dts, args, kwargs):
    """SDPA's Q/K/V and scatter's index/src layouts that HyperParallel's rules require to agree.

    Our rules slice a replicated operand locally to match the others (no communication), so no
    redistribution is implicit here; HyperParallel's rules refuse the call, and strict mode does too.
    """
    hp = _hp_semantic(name, dts, args, kwargs)
    if hp is None:
        return None
    got = ", ".join(f"input {i}: {_placements_text(d._layout)}" for i, d in enumerate(dts))
    msg = (f"strict layouts: {name} with operands laid out unlike each other ({got}): HyperParallel's rule "
           "requires them to agree (without strict layouts a replicated operand is sliced locally to match). "
           "Fix: call .redistribute(mesh, placements) on the operands so that their placements agree, or leave "
           "strict mode (hyper_parallel.strict_layouts(False))")
    return _modes.StrictLayoutError, _join(hp[1], msg), (), name


_SEMANTIC = {"squeeze": _squeeze, _SDPA: _layouts_agree, "scatter": _layouts_agree}


def enforce(info, dts):
    """Strict mode: raise ``info``'s error. Warn-only: warn once per (op, layouts) with the bytes sent."""
    cls, msg, moves, name = info
    if _modes.STATE[0] == _modes.STRICT:
        raise cls(msg)
    key = (name, tuple((i, dts[i]._layout, tl) for i, tl in moves), msg if not moves else None)
    if key in _WARNED:
        return
    _WARNED.add(key)
    from hyper_parallel.dtensor import redistribute_plan as rp
    total = 0
    for i, tl in moves:
        d = dts[i]
        plan = rp.plan(d._layout, tl, tuple(d._gshape), d._local_tensor.element_size())
        total += max(plan.bytes_for_rank(r) for r in range(len(d._layout.rank_list)))
    text = msg.replace("strict layouts: ", "strict layouts (warn only): ", 1)
    text += f" [implicit redistribution: {total} bytes sent by the busiest rank]" if moves else \
        " [no data moved]"
    warnings.warn(text, _modes.ImplicitRedistributionWarning, stacklevel=4)
