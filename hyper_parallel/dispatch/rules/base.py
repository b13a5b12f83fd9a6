"""DistributedOp: the registry of sharding rules, and the shapes rules work with.

A rule answers, for one call of an op on DTensors: which layout each DTensor
input should have (the dispatcher redistributes to it), and which layout each
output has. Rules are classes per op *family*, instantiated once per op name;
instantiation registers the instance. ``op_table.py`` maps torch op names to
rule classes; users register their own with ``MyRule("my_op")``.

Two levels of API:

* ``infer_layout(layouts, extra_args)`` - the simple, HyperParallel-compatible
  form: input layouts (``None`` for non-DTensor args) in, output layout(s) out,
  no redistribution. Enough for most custom ops and ``DFunction``.
* ``strategy(call)`` - the full form used by built-in rules: returns a
  :class:`Strategy` with target input layouts, output layouts and, optionally, a
  local implementation replacing the op on local tensors.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.dtensor.layout import Layout
from hyper_parallel.dtensor import redistribute_plan as rp
from hyper_parallel.dtensor import torch_internals
import torch

_REGISTRY: Dict[str, "DistributedOp"] = {}


class OpCall:
    """What a rule sees about one op call (only built on a cache miss)."""

    __slots__ = ("func", "name", "args", "kwargs", "layouts", "shapes", "mesh", "itemsizes", "dtensor_args")

    def __init__(self, func, name, args, kwargs, dtensor_args, mesh):
        self.func = func
        self.name = name
        self.args = args
        self.kwargs = kwargs
        self.dtensor_args = dtensor_args              # DTensors in flattening order
        self.layouts = [d._layout for d in dtensor_args]
        self.shapes = [tuple(d._gshape) for d in dtensor_args]
        self.itemsizes = [d._local_tensor.element_size() for d in dtensor_args]
        self.mesh = mesh


class Strategy:
    """A rule's answer: target input layouts, output layouts, optional local function.

    ``out_layouts`` mirrors the op's output: a Layout for a tensor, a list/tuple of
    them (``None`` for non-tensor entries) for a sequence; ``local_fn`` replaces
    the op on local tensors (same signature); ``out_shapes`` may give the global
    output shapes when they cannot be inferred on the meta device.
    """

    __slots__ = ("in_layouts", "out_layouts", "local_fn", "out_shapes", "note")

    def __init__(self, in_layouts, out_layouts, local_fn: Callable = None, out_shapes=None, note: str = None):
        self.in_layouts = list(in_layouts)
        self.out_layouts = out_layouts
        self.local_fn = local_fn
        self.out_shapes = out_shapes
        self.note = note


class DistributedOp:
    """Base class of sharding rules; constructing one registers it under ``op_name``.

    Example (a custom op whose output is laid out like its first input)::

        class MyAddDistOp(DistributedOp):
            def infer_layout(self, layouts, extra_args=None):
                return layouts[0]

        MyAddDistOp("MyAdd")
    """

    def __init__(self, op_name: str, *, register: bool = True):
        """``register=False`` builds the rule without serving ``op_name`` with it (for :class:`override`)."""
        if not isinstance(op_name, str) or not op_name:
            raise TypeError(f"DistributedOp(op_name): op_name must be a non-empty string, got {op_name!r}")
        self.op_name = op_name
        if register:
            _register(op_name, self)

    @property
    def float_args_matter(self) -> bool:
        """Whether the *values* of float arguments can change this rule's answer.

        The dispatch cache keys float arguments by type only when this is False, so
        that e.g. an optimizer's step size, which changes every step, does not
        create a new cache entry per step. Rules shipped with hyper_parallel set it
        explicitly (False unless their strategy or local function depends on a float
        value, e.g. dropout's ``p``); user rules default to True (always correct).
        Set ``float_args_matter = False`` on a rule class whose strategy, output
        shapes and local function never look at float values.
        """
        return not type(self).__module__.startswith("hyper_parallel.dispatch.rules.")

    #: True when the rule's answer depends on whether the mesh follows HyperParallel's or PyTorch's
    #: semantics (``semantics_of(mesh)``), not only on the layouts: the dispatch cache then keys its
    #: entries by that too (such calls skip the fast path).
    mesh_semantics_matter = False

    def infer_layout(self, layouts: Sequence[Optional[Layout]], extra_args=None):
        raise NotImplementedError(f"{type(self).__name__} for {self.op_name!r} implements neither infer_layout "
                                  "nor strategy")

    def strategy(self, call: OpCall) -> Strategy:
        """Default: inputs stay as they are; outputs from :meth:`infer_layout`."""
        layouts = []
        extra = []
        it = iter(call.layouts)
        for a in call.args:
            if _is_dtensor(a):
                layouts.append(next(it))
            else:
                layouts.append(None)
                extra.append(a)
        out = self.infer_layout(tuple(layouts), extra)
        if isinstance(out, (tuple, list)) and len(out) == 1 and isinstance(out[0], Layout):
            out = out[0]  # HyperParallel rules return a one-element tuple for a single output
        return Strategy(call.layouts, out)


def _is_dtensor(obj):
    return isinstance(obj, DTensor)


is_dtensor = _is_dtensor


def bind_args(args, kwargs, names) -> Dict[str, Any]:
    """Argument values by name: positional ``args`` matched to ``names`` (extra ones as ``argN``), then ``kwargs``."""
    v = {}
    for i, a in enumerate(args):
        v[names[i] if i < len(names) else f"arg{i}"] = a
    v.update(kwargs)
    return v


# ----------------------------------------------------------------------------- the registry
_INVALIDATE_HOOKS: List[Callable[[], None]] = []


def on_registry_change(callback: Callable[[], None]) -> None:
    """Call ``callback()`` whenever a rule or decomposition is registered or removed (the dispatcher's
    cache clearing)."""
    if not callable(callback):
        raise TypeError(f"on_registry_change: callback must be callable, got {callback!r}")
    _INVALIDATE_HOOKS.append(callback)


def _invalidate():
    for h in _INVALIDATE_HOOKS:
        h()


def _check_entry(what, name, rule):
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what}: name must be a non-empty op name string, got {name!r}")
    if not isinstance(rule, DistributedOp):
        raise TypeError(f"{what}: rule must be a DistributedOp instance, got {type(rule).__name__}")


def register(name: str, rule: "DistributedOp") -> None:
    """Serve op ``name`` with the rule instance ``rule`` from now on (replaces any earlier rule)."""
    _check_entry("register", name, rule)
    _REGISTRY[name] = rule
    _invalidate()


_register = register  # (DistributedOp.__init__'s keyword shadows the name there)


class override:
    """Serve op ``name`` with ``rule`` until undone: ``with override(name, rule): ...`` or
    ``h = override(name, rule); ...; h.undo()``. Undoing restores the rule registered before
    (or none); dispatch caches are cleared both times."""

    def __init__(self, name: str, rule: "DistributedOp"):
        _check_entry("override", name, rule)
        self.name, self.op = name, rule
        self.previous = _REGISTRY.get(name)
        self._active = True
        _REGISTRY[name] = rule
        _invalidate()

    def undo(self) -> None:
        if not self._active:
            return
        self._active = False
        if self.previous is not None:
            _REGISTRY[self.name] = self.previous
        else:
            _REGISTRY.pop(self.name, None)
        _invalidate()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()
        return False


def get_rule(name: str) -> Optional[DistributedOp]:
    return _REGISTRY.get(name)


# ----------------------------------------------------------------------------- helpers for rules
def redistribution_cost(src: Layout, dst: Layout, shape, itemsize: int) -> int:
    """Bytes the most loaded rank sends to turn ``src`` into ``dst`` (0 when equal)."""
    if src == dst or is_local_move(src, dst):
        return 0
    p = rp.plan(src, dst, shape, itemsize)
    return max((sum(s.bytes[i] for s in p.steps) for i in range(len(src.rank_list))), default=0)


def is_local_move(src: Layout, dst: Layout) -> bool:
    """True when ``dst`` is reached from ``src`` without communication (0 bytes, no planning needed).

    Local moves: a mesh dim that neither shards nor is pending in ``src`` may newly
    shard one tensor dim (innermost) or become Partial (when every pending reduction
    has the same op); size-1 mesh dims move no data. Anything else returns False
    (the planner decides).
    """
    if src.mesh_shape != dst.mesh_shape or src.dim_map is None or dst.dim_map is None or \
            len(src.dim_map) != len(dst.dim_map):
        return False
    big = [k > 1 for k in src.mesh_shape]
    busy = {d for m in src.dim_map for d in m}
    busy.update(d for d, p in enumerate(src.partial) if p is not None)
    newly = set()
    for a, b in zip(src.dim_map, dst.dim_map):
        a = tuple(d for d in a if big[d])
        b = tuple(d for d in b if big[d])
        if b[:len(a)] != a:
            return False
        for d in b[len(a):]:
            if d in busy:
                return False
            newly.add(d)
    if src.partial == dst.partial:
        return True
    for d, (p, q) in enumerate(zip(src.partial, dst.partial)):
        if big[d] and p != q and (p is not None or d in busy or d in newly):
            return False
    # new pending reductions only while every pending one (size-1 mesh dims included) has the same op
    return len({p for p in src.partial + dst.partial if p is not None}) <= 1


def input_layout(call, what: str = "input"):
    """Layout and global shape of an op's input: the first positional argument, or ``input=`` / ``self=``.

    Raises ``NotImplementedError`` naming the op when it is not a DTensor, or when another DTensor
    argument comes before it.
    """
    x = call.args[0] if call.args else call.kwargs.get("input", call.kwargs.get("self"))
    if not is_dtensor(x):
        raise NotImplementedError(f"{call.name}: the first tensor argument ({what}) must be a DTensor")
    if call.dtensor_args[0] is not x:
        raise NotImplementedError(f"{call.name}: pass the {what} DTensor first (positionally) when other DTensor "
                                  "arguments are given")
    return call.layouts[0], call.shapes[0]


def uneven_dims(layout: Layout, shape) -> list:
    """The tensor dims whose sharding does not divide their global size."""
    out = []
    ms = layout.mesh_shape
    for t, m in enumerate(layout.dim_map):
        n = 1
        for d in m:
            n *= ms[d]
        if m and shape[t] % n:
            out.append(t)
    return out


def unshard_dims(layout: Layout, dims: Sequence[int]) -> Layout:
    """``layout`` with tensor ``dims`` made unsharded (other shards kept; partials kept)."""
    dims = {d % layout.ndim for d in dims} if layout.ndim else set()
    if not any(layout.dim_map[d] for d in dims):
        return layout
    dm = tuple(() if t in dims else m for t, m in enumerate(layout.dim_map))
    return layout.with_dim_map(dm, layout.partial)


def reduce_all_partial(layout: Layout) -> Layout:
    return layout.without_partial() if layout.has_partial() else layout


# ----------------------------------------------------------------------------- misc tables
# Ops whose plain (non-DTensor) tensor arguments are taken as replicated, as if inside
# ``implicit_replication()``: index tensors, masks and attention masks that programs
# (HyperParallel's included) pass as plain tensors next to DTensors. Rule modules add to it.
PLAIN_AS_REPLICATED: set = set()

_DUNDER_INPLACE = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                   "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def is_inplace(name: str) -> bool:
    """Tensor methods ending in ``_`` (``add_``) and ``__iadd__``-style operators modify their first argument."""
    if name in _DUNDER_INPLACE:
        return True
    return name.endswith("_") and not name.endswith("__") and not name.startswith("_foreach") or (
        name.startswith("_foreach") and name.endswith("_"))


def _dense_order(shape, stride):
    """The dims from outermost to innermost when ``stride`` is a dense (permuted contiguous) layout of
    ``shape``, else None. Size-1 dims do not constrain the order (ties go to the lower dim)."""
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    acc = 1
    for d in reversed(order):
        if shape[d] > 1 and stride[d] != acc:
            return None
        acc *= max(shape[d], 1)
    return order


def _memory_order(self):
    """The global memory order of a DTensor whose local shard is a permuted view (``x.t()``,
    ``x.permute(...)``), as PyTorch's stride propagation gives it; None for row-major.

    Decided from the local strides only where every rank's piece is at least 2 long on each
    sharded dim (worked out from the global shape and layout, so every rank decides alike):
    a piece of size 0 or 1 leaves the order ambiguous on that rank.
    """
    local = self._local_tensor
    lshape, lstride = tuple(local.shape), tuple(local.stride())
    order = _dense_order(lshape, lstride)
    if order is None or order == sorted(order):
        return None
    lay, gshape = self._layout, tuple(self._gshape)
    ms = lay.mesh_shape
    for t, m in enumerate(lay.dim_map or ()):
        if m:
            n = 1
            for d in m:
                n *= ms[d]
            if gshape[t] < 2 * n:  # some rank's piece is shorter than 2
                return None
    return order


def _global_stride(self, dim=None):
    given = self.__dict__.get("_gstride")
    if given is not None:
        return given if dim is None else given[dim]
    shape = tuple(self._gshape)
    order = _memory_order(self) if self._layout.dim_map is not None else None
    if order is None:
        order = range(len(shape))
    strides, acc = [0] * len(shape), 1
    for d in reversed(list(order)):
        strides[d] = acc
        acc *= max(shape[d], 1)
    strides = tuple(strides)
    return strides if dim is None else strides[dim]


def _on_local(name):
    def fn(self, *args, **kwargs):
        return getattr(self._local_tensor, name)(*args, **kwargs)
    return fn


# Ops that only read metadata: answered without layout inference.
METADATA_OPS = {
    "dim": lambda self: len(self._gshape),
    "size": lambda self, dim=None: self._gshape if dim is None else self._gshape[dim],
    "numel": lambda self: self._gshape.numel(),
    "stride": _global_stride,
    "nelement": lambda self: self.numel(),
    "ndimension": lambda self: self.ndim,
    "is_complex": _on_local("is_complex"),
    "is_floating_point": _on_local("is_floating_point"),
    "element_size": _on_local("element_size"),
    "get_device": _on_local("get_device"),
    "is_signed": _on_local("is_signed"),
    "is_contiguous": _on_local("is_contiguous"),
    "is_inference": _on_local("is_inference"),
    "__bool__": lambda self: bool(self.item()),
    "__float__": lambda self: float(self.item()),
    "__int__": lambda self: int(self.item()),
    "__index__": lambda self: int(self.item()),
    "is_shared": lambda self: False,
    "is_pinned": _on_local("is_pinned"),
    "storage_offset": lambda self: 0,
    "untyped_storage": _on_local("untyped_storage"),
    "data_ptr": _on_local("data_ptr"),
    "is_meta": lambda self: self._local_tensor.is_meta,  # a meta DTensor (deferred init) says so
}


# Composite functions (e.g. ``torch.nn.init.uniform_``) that hand a DTensor to ``__torch_function__``
# as a whole: ``func -> fn(*args, **kwargs)`` runs instead, on the DTensors, so that every tensor op
# inside is dispatched on its own. Keyed by the function object (their names clash with Tensor methods).
DECOMPOSITIONS: Dict[Callable, Callable] = {}


def register_decomposition(func: Callable, decomposition: Callable) -> None:
    """Run ``decomposition`` (same signature, DTensor arguments) whenever ``func`` is called with DTensors."""
    DECOMPOSITIONS[func] = decomposition
    _invalidate()


def meta_run(func, args, kwargs):
    """Run ``func`` on meta tensors with the global shapes of the inputs (shape inference)."""

    def conv(arg):
        if isinstance(arg, DTensor):
            return torch_internals.meta_empty(arg._gshape, arg.dtype)
        if isinstance(arg, torch.Tensor):
            return arg.to("meta")
        if isinstance(arg, (list, tuple)) and type(arg) in (list, tuple):
            return type(arg)(conv(x) for x in arg)
        return arg
    with torch_internals.outside_dispatch_modes():  # not seen by e.g. selective activation checkpointing's op log
        return func(*[conv(a) for a in args], **{k: conv(v) for k, v in kwargs.items()})


def replicate_fallback_strategy(call: OpCall) -> Strategy:
    """Gather every DTensor input and run the op replicated (opt-in fallback)."""
    T = torch.Tensor
    ins = [l.replicated() for l in call.layouts]
    base = call.layouts[0]
    out = meta_run(call.func, call.args, call.kwargs)
    if isinstance(out, T):
        outs = base.replicated(out.dim())
    elif isinstance(out, (list, tuple)):
        outs = [base.replicated(o.dim()) if isinstance(o, T) else None for o in out]
    else:
        outs = None
    return Strategy(ins, outs, note="fallback")
