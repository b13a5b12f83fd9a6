"""The op dispatcher: ``DTensor.__torch_function__``, its fast path, and the rule-based path.

(See docs/design.md, "The op path", for the whole walk with file and function names.)

For every op called with DTensor arguments the dispatcher

1. builds a cheap hashable key (op, input layouts and global shapes, the other
   arguments) and looks up a cached :class:`_Entry`; on a miss it asks the op's
   :class:`DistributedOp` rule for a strategy and infers global output shapes on
   the meta device;
2. redistributes inputs whose layout differs from the strategy's (differentiable,
   cheapest plan) - or raises in strict mode;
3. gives inputs that are replicated on a mesh dim where an output is sharded or
   partial a "partial gradient" view (one all_reduce / reduce_scatter of their
   gradient, shared by all such consumers);
4. runs the op (or the rule's local implementation) on local tensors, so autograd
   records plain local ops and backward has no DTensor overhead;
5. wraps the outputs as DTensors (in-place ops return their DTensor input).
"""
from __future__ import annotations

import logging
import warnings

from hyper_parallel.dtensor import skip_and_replication as _ds
from hyper_parallel.dtensor import dtensor as _dt
from hyper_parallel.dtensor.mesh_semantics import semantics_of
from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.dtensor.layout import Layout as _Layout
from hyper_parallel.dtensor.redistribute import partial_grad_view
from hyper_parallel.dtensor import fast_path as _fast_path
from hyper_parallel.dispatch import strict_layouts as _strict
from hyper_parallel.dispatch import modes as _modes
from hyper_parallel.dispatch.mesh_split import split_by_mesh as _split_by_mesh
from hyper_parallel.dispatch.call_args import (_check_plain_tensors, _collect, _inplace_target, _op_name, _replace,
                                             _signature, _signature_without_floats)
from hyper_parallel.dispatch.rules import base as _base
from hyper_parallel.compile import compile_mode
import torch

_Tensor = torch.Tensor
_log = logging.getLogger("hyper_parallel.dispatch")
_FLAGS = _modes.FLAGS                    # fallback, debug
_WARNED_FALLBACK = _modes.WARNED_FALLBACK
_STRICT_MODE = _modes.STATE
_SKIP_ANY = _ds.SKIP_ANY                 # active SkipDTensorDispatch contexts (any thread)
_NO_SKIP_GLOBAL = _ds.NO_SKIP_GLOBAL
_current_skip = _ds.current_skip
_SPECIAL = _dt.SPECIAL_METHODS           # special-cased methods (dtensor/special_methods.py)


# ----------------------------------------------------------------------------- caches
class _Entry:
    __slots__ = ("in_layouts", "partial_grad_groups", "out_layouts", "out_shapes", "local_fn", "inplace", "redistributes",
                 "fallback", "strict", "mesh", "partial_grad_inputs", "set_meta", "out_spec", "fn", "plain_conv")

    def __init__(self):
        self.fallback = False
        self.set_meta = False
        self.plain_conv = False  # built after plain tensors were taken as replicated (redo that on a hit)


_CACHE: dict = {}
# (func, spec | scalar, ...) -> entry (spec: dtensor.Spec), for calls with positional DTensor/scalar
# arguments that need no redistribution, are not in place and return one tensor (the rule's local
# implementation, if any, and partial-gradient views are applied inline). The table lives in the
# DTensor core (dtensor/fast_path.py) because the class's fast methods read it; this module fills it.
_FAST = _fast_path.FAST
# Both caches are bounded (oldest entry evicted): a program with unboundedly many distinct calls
# (e.g. shapes that change every step) must not grow them forever.
_CACHE_MAX = 8192
# func -> whether float argument values are part of its cache key (see DistributedOp.float_args_matter)
_FLOATS_MATTER: dict = {}
_SCALARS = _fast_path.SCALARS
_INDEX_OPS = frozenset({"__getitem__", "__setitem__", "index_select", "gather", "index", "take_along_dim"})
_BOOL = torch.bool
_TENSOR_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
_STATS = {"hits": 0, "misses": 0}


def _clear_caches():
    _CACHE.clear()
    _FAST.clear()
    _FLOATS_MATTER.clear()


_base.on_registry_change(_clear_caches)
_modes.on_switch_change(_clear_caches)


def _fast_eligible(entry, args, kwargs):
    Layout = _Layout
    return (all(type(v) in _SCALARS for v in kwargs.values()) and not entry.redistributes and not entry.inplace
            and not entry.fallback and entry.strict is None
            and isinstance(entry.out_layouts, Layout) and entry.out_shapes is not DERIVE_SHAPES
            and all(type(a) is DTensor or type(a) in _SCALARS for a in args))


def _floats_matter(func, name):
    m = _FLOATS_MATTER.get(func)
    if m is None:
        rule = _base.get_rule(name)
        m = _FLOATS_MATTER[func] = rule is None or bool(rule.float_args_matter)
    return m


def _bounded_put(cache, key, value):
    if len(cache) >= _CACHE_MAX:
        del cache[next(iter(cache))]
    cache[key] = value


# Special-cased Tensor methods that keep their DTensor meaning even inside SkipDTensorDispatch
# (printing and the pickling guard); every other special (detach, item, tolist, backward...) runs on
# the local tensor there, like any op.
_SPECIAL_UNDER_SKIP = frozenset({"__repr__", "__format__", "__setstate__"})


def _slow_path(func, types, args, kwargs):
    if _DYNAMO_LOADED() and _COMPILING():  # the compiler asking about the wrapper (is_conj...)
        out = _COMPILE.native_query(func, args, kwargs)
        if out is not NotImplemented:
            return out
    if _SKIP_ANY[0]:
        st = _current_skip()
        if st is not None:
            no_skip = st[1][-1]  # the innermost context decides
            name = _op_name(func)
            extra = _NO_SKIP_GLOBAL[0]
            if not (func in no_skip or name in no_skip) and not (
                    name in _SPECIAL_UNDER_SKIP and func in _SPECIAL) and not (
                    extra and (func in extra or name in extra)):
                return _run_local(func, args, kwargs)
    special = _SPECIAL.get(func)
    if special is not None:
        return special(*args, **kwargs)
    return _RULE_DISPATCHER.dispatch(func, args, kwargs)


def _fast_key(func, args):
    return _fast_path.fast_key(_DT, func, args)


def _fast_key_kw(func, args, kwargs):
    return _fast_path.fast_key_kw(_DT, func, args, kwargs)


_run_pg = _fast_path.run_with_partial_grads
_fast_call_kw = _fast_path.fast_call_kw  # (cls, func, args, kwargs)


def _torch_function(cls, func, types, args=(), kwargs=None):
    """DTensor.__torch_function__: the hot path inlined, everything else via :func:`_slow_path`.

    The fast-path key is built exactly as :meth:`OpDispatcher._dispatch` stores it:
    ``(func, spec | scalar, ...)`` per positional argument, where a DTensor's spec is
    its interned (layout, global shape) token (hashed in C). One- and two-argument
    calls (most ops) build it without a loop.
    """
    if not kwargs and not _SKIP_ANY[0]:
        n = len(args)
        key = None
        if n == 2:
            a, b = args
            ta, tb = type(a), type(b)
            if ta is _DT:
                if tb is _DT:
                    key = (func, a._spec, b._spec)
                elif tb in _SCALARS:
                    key = (func, a._spec, b)
            elif tb is _DT and ta in _SCALARS:
                key = (func, a, b._spec)
        elif n == 1:
            a = args[0]
            if type(a) is _DT:
                key = (func, a._spec)
        else:
            key = _fast_key(func, args)
        if key is not None:
            entry = _FAST.get(key)
            if entry is not None:
                if n == 2:
                    la = a._local_tensor if ta is _DT else a
                    lb = b._local_tensor if tb is _DT else b
                    # partial-gradient views matter only for inputs that require grad
                    if entry.partial_grad_inputs is None or not ((ta is _DT and la.requires_grad) or
                                                     (tb is _DT and lb.requires_grad)):
                        out = entry.fn(la, lb)
                    else:
                        out = _run_pg(entry, [la, lb])
                elif entry.partial_grad_inputs is None:
                    if n == 1:
                        out = entry.fn(a._local_tensor)
                    else:
                        out = entry.fn(*[x._local_tensor if type(x) is _DT else x for x in args])
                else:
                    out = _run_pg(entry, [x._local_tensor if type(x) is _DT else x for x in args])
                # _wrap_entry inlined: this is the per-op hot path (a call costs ~0.07 us)
                shape = entry.out_shapes
                r = _make_wrapper(_DT, shape, None, None, None, out.dtype, _STRIDED, out.device)
                r._local_tensor = out
                r._mesh = entry.mesh
                r._layout = entry.out_layouts
                r._gshape = shape
                r._spec = entry.out_spec
                return r
        special = _SPECIAL.get(func)
        if special is not None:
            return special(*args, **(kwargs or {}))
    elif kwargs and not _SKIP_ANY[0]:
        out = _fast_call_kw(_DT, func, args, kwargs)
        if out is not None:
            return out
    # SkipDTensorDispatch, special-cased methods under it, cache misses
    return _slow_path(func, types, args, kwargs or {})


def _out_via_copy(func, name, args, kwargs):
    """``op(..., out=dt)`` for a rule without its own ``out=`` support: the result, copied into ``dt``.

    ``out`` keeps its identity, local tensor and layout (the result is redistributed
    to it by ``copy_``); it may alias an input (``torch.maximum(a, b, out=a)``, as the
    amsgrad step does). A DTensor cannot be resized in place, so the global shapes
    must match; like PyTorch, ``out=`` refuses inputs that require grad.
    """
    out = kwargs["out"]
    rest = {k: v for k, v in kwargs.items() if k != "out"}
    if torch.is_grad_enabled():
        dts = []
        _collect(args, dts)
        _collect(rest.values(), dts)
        if any(d._local_tensor.requires_grad for d in dts) or out._local_tensor.requires_grad:
            raise RuntimeError(f"{name}(): functions with out=... arguments don't support automatic "
                               "differentiation, but one of the arguments requires grad")
    res = func(*args, **rest)
    if not isinstance(res, DTensor):
        raise NotImplementedError(f"{name}(..., out=DTensor): the op returned {type(res).__name__}, not one "
                                  "DTensor; assign the result instead (y = op(...))")
    if tuple(res._gshape) != tuple(out._gshape):
        raise ValueError(f"{name}(..., out=...): the out= DTensor has global shape {tuple(out._gshape)} but the "
                         f"result has {tuple(res._gshape)}; a DTensor cannot be resized in place")
    out.copy_(res)
    return out


def _run_local(func, args, kwargs):
    """SkipDTensorDispatch path: run on local tensors, return local results."""
    dts = []
    _collect(args, dts)
    _collect(kwargs.values(), dts)
    it = iter([d._local_tensor for d in dts])
    largs = _replace(args, it)
    lkw = dict(zip(kwargs, _replace(list(kwargs.values()), it))) if kwargs else kwargs
    return func(*largs, **lkw)


class OpDispatcher:
    """Routes ops on DTensors through their sharding rules (see module docstring)."""

    def dispatch(self, func, args, kwargs=None):
        """Run ``func`` on DTensor arguments (the fast path lives in :func:`_torch_function`)."""
        return self._dispatch(func, args, kwargs or {})

    def _dispatch(self, func, args, kwargs):
        dts = []
        _collect(args, dts)
        if kwargs:
            _collect(kwargs.values(), dts)
        if not dts:
            return func(*args, **kwargs)
        decomp = _base.DECOMPOSITIONS.get(func)
        if decomp is not None:
            return decomp(*args, **kwargs)
        name = _op_name(func)
        if name[0] == "_" and (name.startswith("_foreach_") or name.startswith("_fused_")):
            res = _split_by_mesh(func, name, args, kwargs, dts)  # list entries on several meshes
            if res is not NotImplemented:
                return res
        meta_ops = _base.METADATA_OPS.get(name)
        if meta_ops is not None:
            return meta_ops(*args, **kwargs)
        if getattr(func, "__name__", None) == "__get__" and name not in _TENSOR_PROPERTIES:
            # metadata properties (is_sparse, is_cuda, itemsize...) read from the local tensor
            return getattr(args[0]._local_tensor, name)
        if kwargs and type(kwargs.get("out")) is DTensor and not getattr(_base.get_rule(name), "supports_out", False):
            return _out_via_copy(func, name, args, kwargs)
        mesh = dts[0]._mesh
        sig = _signature if _floats_matter(func, name) else _signature_without_floats
        key = (func, tuple(sig(a) for a in args), tuple((k, sig(v)) for k, v in kwargs.items()) if kwargs else ())
        semantic = getattr(_base.get_rule(name), "mesh_semantics_matter", False)
        if semantic:  # the rule answers differently on HyperParallel and PyTorch meshes with equal layouts
            key += (semantics_of(mesh),)
        entry = _CACHE.get(key)
        if entry is None:
            converted = False
            if not name.startswith("_foreach_"):  # foreach lists may hold plain parameters
                a0, k0 = args, kwargs
                args, kwargs = _check_plain_tensors(func, args, kwargs, mesh)
                converted = args is not a0 or kwargs is not k0
            dts = []
            _collect(args, dts)
            _collect(kwargs.values(), dts)
            entry = self._build(func, args, kwargs, dts, mesh)
            if entry is not None and converted and (name in _base.PLAIN_AS_REPLICATED
                                                    or semantics_of(mesh).plain_tensors_replicated):
                # plain index/mask tensors of these ops are always replicated: cache the entry under the
                # call's own key (not the fast path); a hit converts them again, as here
                entry.plain_conv = True
                _bounded_put(_CACHE, key, entry)
            # (other plain tensors converted above change the signature: such calls are not cached)
            elif entry is not None and key[1] == tuple(sig(a) for a in args) and (
                    not kwargs or key[2] == tuple((k, sig(v)) for k, v in kwargs.items())):
                _bounded_put(_CACHE, key, entry)
                if mesh._coord is not None and not semantic and _fast_eligible(entry, args, kwargs):
                    entry.mesh = mesh
                    # DTensor positional args are the DTensors in order: map partial_grad_groups to arg positions
                    pos = [i for i, a in enumerate(args) if type(a) is DTensor]
                    pg = tuple((pos[j], g) for j, g in enumerate(entry.partial_grad_groups) if g is not None)
                    entry.partial_grad_inputs = pg or None
                    entry.fn = entry.local_fn or func  # what runs on the local tensors
                    entry.out_shapes = torch.Size(entry.out_shapes)
                    entry.out_spec = _dt.spec_of(entry.out_layouts, entry.out_shapes)
                    _bounded_put(_FAST, _fast_key_kw(func, args, kwargs) if kwargs else _fast_key(func, args), entry)
            _STATS["misses"] += 1
        else:
            if entry.plain_conv:
                args, kwargs = _check_plain_tensors(func, args, kwargs, mesh)
                dts = []
                _collect(args, dts)
                _collect(kwargs.values(), dts)
            _STATS["hits"] += 1
        return self._execute(entry, func, args, kwargs, dts, mesh)

    # ------------------------------------------------------------------ build (cache miss)
    def _build(self, func, args, kwargs, dts, mesh):
        name = _op_name(func)
        for d in dts[1:]:
            if d._mesh != mesh:
                raise ValueError(f"{name}: DTensor inputs live on different meshes ({mesh} and {d._mesh}); "
                                 "move one onto the other's mesh first with .redistribute(mesh, placements)")
        for i, d in enumerate(dts):
            if d._layout.strided is not None:  # its pieces are not boxes: no sharding rule reads them
                raise NotImplementedError(
                    f"{name}: DTensor input {i} has placements {list(d._layout.placements)}, a _StridedShard whose "
                    "split_factor no order of the mesh dims explains; operators do not run on it. Redistribute it "
                    "first, e.g. x.redistribute(placements=[Shard(d) or Replicate() ...]), or use x.to_local()")
        rule = _base.get_rule(name)
        call = _base.OpCall(func, name, args, kwargs, dts, mesh)
        entry = _Entry()
        if rule is None:
            if not _FLAGS["fallback"]:
                raise NotImplementedError(
                    f"hyper_parallel has no sharding rule for op '{name}' (input layouts: "
                    f"{[str(l) for l in call.layouts]}). Register one with a DistributedOp subclass, e.g. "
                    f"`class MyRule(hyper_parallel.DistributedOp): def infer_layout(self, layouts, extra_args): ...` "
                    f"then `MyRule('{name}')`, or enable hyper_parallel.allow_replicate_fallback() to gather inputs "
                    "and run it replicated")
            strategy = _base.replicate_fallback_strategy(call)
            entry.fallback = True
            if name not in _WARNED_FALLBACK:
                _WARNED_FALLBACK.add(name)
                warnings.warn(f"hyper_parallel: op '{name}' has no sharding rule; running it replicated "
                              "(inputs gathered on every rank). Register a DistributedOp to avoid the communication.",
                              stacklevel=4)
        else:
            strategy = rule.strategy(call)
        in_layouts = list(strategy.in_layouts)
        if len(in_layouts) != len(dts):
            raise RuntimeError(f"rule for '{name}' returned {len(in_layouts)} input layouts for {len(dts)} DTensors")
        redist = [None if tl is None or tl == d._layout or _same_data(d._layout, tl) else tl
                  for d, tl in zip(dts, in_layouts)]
        entry.strict = _strict.violation(name, dts, redist, args, kwargs)  # strict layouts (None: fine)
        if _FLAGS["debug"] and any(r is not None for r in redist):
            got = ", ".join(f"input {i}: {_placements_text(d._layout)}" for i, d in enumerate(dts))
            changes = ", ".join(f"input {i} {_placements_text(dts[i]._layout)} -> {_placements_text(r)}" for i, r in enumerate(redist) if r)
            _log.warning("hyper_parallel: %s redistributes %s (inputs: %s)", name, changes, got)
        entry.in_layouts = redist
        entry.out_layouts = strategy.out_layouts
        entry.local_fn = strategy.local_fn
        entry.inplace = _base.is_inplace(name) or isinstance(kwargs.get("out"), DTensor)
        entry.redistributes = any(r is not None for r in redist)
        final_in = [tl or d._layout for d, tl in zip(dts, in_layouts)]
        entry.partial_grad_groups = _partial_groups(final_in, strategy.out_layouts, mesh)
        entry.out_shapes = strategy.out_shapes if strategy.out_shapes is not None else \
            _meta_shapes(func, args, kwargs, strategy.out_layouts, entry.inplace, dts)
        if entry.inplace:
            target = _inplace_target(args, kwargs, dts)
            lay = strategy.out_layouts
            # an in-place op whose rule gives its target a new layout or shape (t_, transpose_)
            entry.set_meta = target is not None and isinstance(lay, _Layout) and (
                lay != target._layout or tuple(entry.out_shapes) != tuple(target._gshape))
        return entry

    # ------------------------------------------------------------------ execute (every call)
    def _execute(self, entry, func, args, kwargs, dts, mesh):
        if mesh._coord is None:
            return _off_mesh_result(entry, func, args, kwargs, dts, mesh)
        if entry.strict is not None and _STRICT_MODE[0] and not entry.fallback:
            _strict.enforce(entry.strict, dts)
        locals_ = []
        for i, d in enumerate(dts):
            tl = entry.in_layouts[i]
            loc = d._local_tensor if tl is None else d._redistribute_local(tl)
            pg = entry.partial_grad_groups[i]
            if pg is not None and loc.requires_grad:
                for g in pg:
                    loc = partial_grad_view(loc, g)
            locals_.append(loc)
        it = iter(locals_)
        largs = _replace(args, it)
        lkw = dict(zip(kwargs, _replace(list(kwargs.values()), it))) if kwargs else kwargs
        fn = entry.local_fn or func
        out = fn(*largs, **lkw)
        if entry.inplace:
            target = _inplace_target(args, kwargs, dts)
            if target is not None:
                if entry.set_meta:
                    _set_metadata(target, entry.out_layouts, entry.out_shapes, out)
                return target
        return _wrap(out, entry.out_layouts, entry.out_shapes, mesh)


def _off_mesh_result(entry, func, args, kwargs, dts, mesh):
    """An op on DTensors of a mesh this rank is not part of: no computation, no collective (PyTorch semantics).

    Tensor outputs get the right global metadata and an empty local tensor (a 0-d
    zero for 0-d outputs); in-place ops return their target; an op without tensor
    outputs runs its rule's local function on the empty shards (``equal`` -> True).
    """
    if entry.inplace:
        target = _inplace_target(args, kwargs, dts)
        if target is not None:
            return target
    if entry.out_layouts is None:
        it = iter([d._local_tensor for d in dts])
        largs = _replace(args, it)
        lkw = dict(zip(kwargs, _replace(list(kwargs.values()), it))) if kwargs else kwargs
        return (entry.local_fn or func)(*largs, **lkw)
    meta = _base.meta_run(func, args, kwargs)
    # keep the autograd graph connected (zero gradients), so a backward() that every rank runs works here too
    needs = [d._local_tensor for d in dts if d._local_tensor.requires_grad] if torch.is_grad_enabled() else []
    anchor = sum(t.sum() for t in needs) * 0 if needs else None

    def empty(meta_out, lay, shape):
        if lay is None or not isinstance(meta_out, _Tensor):
            return meta_out
        base = dts[0]._local_tensor
        local = base.new_zeros((), dtype=meta_out.dtype) if meta_out.dim() == 0 else base.new_empty((0,), dtype=meta_out.dtype)
        if anchor is not None and local.is_floating_point():
            local = local + anchor.to(local.dtype)
        return DTensor._wrap(local, mesh, lay, shape if shape is not None else torch.Size(meta_out.shape))
    if isinstance(meta, _Tensor):
        return empty(meta, entry.out_layouts, entry.out_shapes if isinstance(entry.out_shapes, torch.Size)
                     else None)
    shapes = entry.out_shapes if isinstance(entry.out_shapes, (list, tuple)) else [None] * len(meta)
    items = [empty(m, l, s if isinstance(s, torch.Size) else None)
             for m, l, s in zip(meta, entry.out_layouts, shapes)]
    return type(meta)(items) if type(meta) in (list, tuple) else type(meta)(items)


def _set_metadata(target, layout, shape, local):
    """An in-place op changed the layout/shape of ``target`` (``t_``, ``transpose_``): update its metadata."""
    target._layout = layout
    target._gshape = shape if type(shape) is torch.Size else torch.Size(shape)
    target._spec = _dt.spec_of(layout, target._gshape)
    if isinstance(local, _Tensor) and not isinstance(local, DTensor) and local is not target._local_tensor:
        target._local_tensor = local
    target.__dict__.pop("_redist_cache", None)
    target.__dict__.pop("_grad_wrapper", None)


def _placements_text(layout):
    """Placements of a layout, short: ``[S(0), R]``."""
    return "[" + ", ".join(str(p) for p in layout.placements) + "]"


DERIVE_SHAPES = "derive"


def _wrap(out, layouts, shapes, mesh):
    if layouts is None:
        return out
    if shapes is DERIVE_SHAPES:  # even-shard assumption when meta inference was impossible
        if isinstance(out, _Tensor):
            shapes = layouts.global_shape(tuple(out.shape))
        else:
            shapes = [l.global_shape(tuple(o.shape)) if l is not None and isinstance(o, _Tensor) else None
                      for o, l in zip(out, layouts)]
    if isinstance(out, _Tensor):
        return DTensor._wrap(out, mesh, layouts, shapes)
    if isinstance(out, (list, tuple)):
        items = [o if l is None or not isinstance(o, _Tensor) else DTensor._wrap(o, mesh, l, s)
                 for o, l, s in zip(out, layouts, shapes)]
        if type(out) in (list, tuple):
            return type(out)(items)
        if hasattr(type(out), "n_fields"):  # torch.return_types.* (structseq) take one sequence
            return type(out)(items)
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    return out


def _same_data(src, dst) -> bool:
    """True when ``src`` and ``dst`` differ only on size-1 mesh dims (identical local data)."""
    if src.ndim != dst.ndim:
        return False
    keep = [k > 1 for k in src.mesh_shape]
    strip = lambda lay: (tuple(tuple(d for d in m if keep[d]) for m in lay.dim_map),
                         tuple(p if keep[d] else None for d, p in enumerate(lay.partial)))
    return strip(src) == strip(dst)


def _partial_groups(in_layouts, out_layouts, mesh):
    if mesh._coord is None:  # outside the mesh nothing runs (see _off_mesh_result)
        return [None] * len(in_layouts)
    outs = _flat_layouts(out_layouts)
    mesh_ndim = mesh.ndim
    non_rep = [False] * mesh_ndim
    for lo in outs:
        for d in range(mesh_ndim):
            if lo.partial[d] is not None or lo.tensor_dim_of(d) is not None:
                non_rep[d] = True
    res = []
    for li in in_layouts:
        groups = []
        for d in range(mesh_ndim):
            if non_rep[d] and li.partial[d] is None and li.tensor_dim_of(d) is None and mesh.size(d) > 1:
                groups.append(mesh.get_comm_group(d))
        res.append(tuple(groups) if groups else None)
    return res


def _flat_layouts(lay):
    if lay is None:
        return []
    if isinstance(lay, (list, tuple)):
        out = []
        for x in lay:
            out.extend(_flat_layouts(x))
        return out
    return [lay]


def _meta_shapes(func, args, kwargs, out_layouts, inplace, dts):
    """Global output shapes, by running the op on meta tensors of the global input shapes."""
    if out_layouts is None:
        return None
    if inplace:
        target = _inplace_target(args, kwargs, dts)
        if target is not None:
            return target._gshape
    try:
        out = _base.meta_run(func, args, kwargs)
    except Exception:  # noqa: BLE001 - e.g. a custom function that is not meta-compatible
        return DERIVE_SHAPES
    if isinstance(out, _Tensor):
        return torch.Size(out.shape)
    if isinstance(out, (list, tuple)):
        return [torch.Size(o.shape) if isinstance(o, _Tensor) else None for o in out]
    return None


_RULE_DISPATCHER = OpDispatcher()
_DT = DTensor
_make_wrapper = _dt._make_wrapper
_STRIDED = _dt._STRIDED


# ----------------------------------------------------------------------------- the dispatcher object
def _compile_torch_function(cls, func, types, args=(), kwargs=None):
    """``__torch_function__`` in compile mode: while dynamo traces, one opaque node per op
    (``compile_mode.traced_op``); otherwise (eager, fake propagation, AOTAutograd) the eager path."""
    if _DYNAMO_COMPILING():
        return _COMPILE.traced_op(func, args, kwargs or {})
    return _torch_function(cls, func, types, args, kwargs)


class EntryDispatcher:
    """The one object ``DTensor.__torch_function__`` delegates to; eager or compile mode.

    ``torch_function`` is the entry (eager: :func:`_torch_function`, the fast path inlined; compile:
    :func:`_compile_torch_function`); ``handle`` the slow path. The mode changes once per process, the
    first time dynamo meets a DTensor (``compile_mode`` calls :meth:`set_mode`), and back with
    ``compile_mode.restore_eager_fast_paths()``.
    """

    __slots__ = ("mode", "torch_function", "handle")

    def __init__(self):
        self.mode = "eager"
        self.torch_function = _torch_function
        self.handle = _slow_path

    def set_mode(self, mode: str) -> None:
        if mode not in ("eager", "compile"):
            raise ValueError(f"EntryDispatcher.set_mode: mode must be 'eager' or 'compile', got {mode!r}")
        _dt.set_mode(mode)  # the class's eager-only methods leave (compile) or come back (eager)
        self.torch_function = _compile_torch_function if mode == "compile" else _torch_function
        self.mode = mode


_COMPILE = compile_mode
_COMPILING = _COMPILE.is_compiling
_DYNAMO_COMPILING = _COMPILE.is_dynamo_compiling
_DYNAMO_LOADED = _COMPILE.is_dynamo_loaded  # the compile state is read through its function, never its table

ENTRY = EntryDispatcher()
_dt.set_dispatcher(ENTRY)
_COMPILE.install(DTensor, _torch_function, (_Layout, _dt.DeviceMesh, _dt.Shard, _dt.Replicate, _dt.Partial),
                 ENTRY.set_mode)


def cache_stats() -> dict:
    """Dispatch cache hits and misses (misses run layout inference)."""
    return dict(_STATS)


def clear_cache() -> None:
    _clear_caches()


def dispatch(func, args, kwargs=None):
    """Run ``func`` on DTensor arguments through its sharding rule (no special-method or
    SkipDTensorDispatch handling: the rule-based path only)."""
    return _RULE_DISPATCHER.dispatch(func, args, kwargs)


def handle(func, args, kwargs=None):
    """Run ``func`` as ``DTensor.__torch_function__`` would after the fast path: SkipDTensorDispatch,
    special-cased methods, then the rule-based dispatcher."""
    return _slow_path(func, (), args, kwargs or {})
