"""``torch.compile`` support for DTensor: dynamo sees one opaque graph node per DTensor op.

Design (see docs/design.md, "torch.compile"): dynamo never traces our dispatcher.

* **DTensor is a traceable wrapper subclass** (``__tensor_flatten__`` /
  ``__tensor_unflatten__``: the local tensor is the only inner tensor; mesh,
  layout and global shape are the constant context), so dynamo can fakeify
  DTensor inputs and parameters and carry DTensor values through its graph.
* **Every DTensor op is a ``nonstrict_trace`` call.** When dynamo inlines
  ``DTensor.__torch_function__`` (or ``from_local`` / ``to_local`` /
  ``redistribute`` / ``full_tensor``), the call is routed to a per-op function
  marked ``torch._dynamo.nonstrict_trace``: dynamo records it as one node and
  runs it natively on fake DTensors to get the output's metadata; AOTAutograd
  then runs the same Python natively while tracing, so the sharding rules,
  caches and layout arithmetic are constant-folded and only the *local*
  program (aten ops on local tensors plus functional collectives, forward and
  backward) lands in the graph.
* **Layouts, placements and meshes are opaque value constants**
  (``register_opaque_type(typ="value")``): dynamo specialises on them (guards
  by ``__eq__``) and never traces their construction.
* **Python-level fast methods are eager only.** Dynamo refuses to inline
  Tensor methods a subclass overrides, so the first time dynamo meets a DTensor
  the fast methods (``dtensor/fast_path.py: METHODS``) and the overridden
  ``size``/``dim``/``numel``/``to``/``float`` are removed from the class for the
  rest of the process: outside compiled regions those calls then take the
  ordinary ``__torch_function__`` path (same results, ~1 us slower per call).

* **Eagerly computed non-leaf DTensors can enter a region** (``_is_example_history``,
  ``_make_dispatch``), and **module hooks that must stay eager** (FSDP's) are wrapped by
  :func:`eager_hook`. Shapes are static: DTensor nodes refuse symbolic sizes (``_require_static``).

Everything torch-specific about compilation lives here; the core only calls
:func:`traced_op` / :func:`native_query`.
"""
from __future__ import annotations

import torch
from torch._library.opaque_object import MemberType, register_opaque_type

is_dynamo_compiling = torch.compiler.is_dynamo_compiling
is_compiling = torch.compiler.is_compiling

_STATE = {"dtensor": None, "handler": None, "compile_mode": False, "on_mode": None, "dynamo_loaded": False}

def is_dynamo_loaded() -> bool:
    """Whether dynamo has met a DTensor in this process (the dispatcher's compile-time branch is live)."""
    return bool(_STATE["dynamo_loaded"])




# ----------------------------------------------------------------------------- opaque constants
_CONSTS: list = []
_CONST_IDS: dict = {}


def _const(index):
    """FX-codegen accessor of a constant baked into a graph (see ``__fx_repr__``)."""
    return _CONSTS[index]


def _fx_repr(self):
    """How a layout/placement/mesh constant is written in generated FX code: an index into a table."""
    i = _CONST_IDS.get(id(self))
    if i is None or _CONSTS[i] is not self:
        _CONSTS.append(self)
        i = _CONST_IDS[id(self)] = len(_CONSTS) - 1
    return f"_hp_compile_const({i})", {"_hp_compile_const": _const}


# members dynamo must inline (they return a ProcessGroup, a reference-type opaque object that needs a
# source: torch's DeviceMesh.get_group is registered the same way); e.g. torchtitan's compiled loss
# calls ``pred.device_mesh.get_group("tp")``
_INLINED = {"DeviceMesh": ("get_group", "get_comm_group", "_dim_index")}


def _members(cls):
    names = {k for k in dir(cls) if not k.startswith("__")}
    for c in cls.__mro__:
        names.update(getattr(c, "__slots__", ()))
    inlined = _INLINED.get(cls.__name__, ())
    return {n: (MemberType.INLINED if n in inlined else MemberType.USE_REAL) for n in names}


class _NoneArg:
    """Stands in for ``None`` in a traced op's arguments (nonstrict_trace inputs cannot be None)."""

    __slots__ = ()

    def __eq__(self, other):
        return isinstance(other, _NoneArg)

    def __hash__(self):
        return 0

    def __repr__(self):
        return "None"


_NONE = _NoneArg()


def _register_constants(classes):
    for cls in classes + (_NoneArg,):
        cls.__fx_repr__ = _fx_repr
        try:
            register_opaque_type(cls, typ="value", members=_members(cls))
        except TypeError as e:
            # an older torch (2.11 asks value types to subclass its OpaqueBase): eager DTensor code
            # works; compiling DTensor code is refused with this reason (see _require_opaque)
            _STATE["opaque_error"] = f"{type(e).__name__}: {e}"
            return


def _require_opaque():
    """Raise a clear error where torch.compile would meet a DTensor on a torch without our opaque constants."""
    err = _STATE.get("opaque_error")
    if err:
        raise RuntimeError(f"torch.compile of DTensor code needs torch 2.13's opaque value types; this torch "
                           f"({torch.__version__}) refused them ({err[:200]}). Eager DTensor code is unaffected.")


# ----------------------------------------------------------------------------- flatten / unflatten
def _is_traced(obj) -> bool:
    """True for the fake/functional tensors of a trace (a real local tensor is a plain torch.Tensor)."""
    return type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter)


def _is_example_history(tensor) -> bool:
    """True for the fake history the meta converter gives a non-leaf example input.

    When dynamo fakeifies a DTensor whose local tensor is a non-leaf that requires
    grad (an eagerly computed activation fed to a compiled block), the inner fake
    local tensor gets a ``DelayedError`` grad_fn. Our wrapper reports the local
    tensor's autograd state, so the converter would then see a non-leaf wrapper
    and refuse it ("the callback you passed in doesn't detach"); it gives the
    *wrapper* its fake history itself afterwards.
    """
    fn = tensor.grad_fn
    return fn is not None and type(fn).__name__ == "Error" and _is_traced(tensor)


def fake_detach(DTensor, func, args):
    """The meta converter's ``aten.detach`` of a fake non-leaf DTensor input, else None (``DTensor.__torch_dispatch__``).

    After fakeifying a non-leaf DTensor input, the converter gives the wrapper an
    error-raising history with ``DelayedError``, which calls ``aten.detach`` below
    ``__torch_function__``. For a fake local tensor that detach is answered here: a new
    wrapper whose local tensor carries the same error-raising history (this library keeps
    autograd state on the local tensor, so that is where the converter's check looks);
    every other call returns None and the caller raises its usual error.
    """
    if func is _DETACH and len(args) == 1 and isinstance(args[0], DTensor) and _is_traced(args[0]._local_tensor):
        a = args[0]
        local = a._local_tensor.detach()
        if a._local_tensor.requires_grad:
            local = torch._C._functions.DelayedError(
                "Internal error: Tried to backward() through example input", 1)(local.requires_grad_(True))
        return DTensor._wrap(local, a._mesh, a._layout, a._gshape)
    return None


_DETACH = torch.ops.aten.detach.default


def tensor_unflatten(DTensor, inner_tensors, meta):
    """``DTensor.__tensor_unflatten__``: rebuild the wrapper from its fake local tensor (see above)."""
    mesh, layout, shape = meta
    local = inner_tensors["_local_tensor"]
    if local.requires_grad and _is_example_history(local):
        local = local.detach().requires_grad_(True)  # a leaf; see _is_example_history
    return DTensor._wrap(local, mesh, layout, shape)


# ----------------------------------------------------------------------------- gradients
# AOTAutograd differentiates a compiled graph through an autograd.Function applied to the
# *wrapper* DTensors, while this library keeps autograd history on the local tensors. The
# core's function bridge (hyper_parallel/dtensor/function_bridge.py) runs any
# autograd.Function called with DTensors on their local tensors, AOT's included, so gradients
# reach parameters' local tensors and a DTensor returned by a compiled region carries its
# history on its local tensor, as in eager.


# ----------------------------------------------------------------------------- argument encoding
def _map_leaves(value, leaf):
    """``leaf`` applied to every non-container value of nested tuples, lists and dicts."""
    t = type(value)
    if t is tuple or t is list:
        return t(_map_leaves(v, leaf) for v in value)
    if t is dict:
        return {k: _map_leaves(v, leaf) for k, v in value.items()}
    return leaf(value)


def _enc(args):
    """Arguments for a traced node: ``None`` becomes the opaque ``_NONE`` constant."""
    return _map_leaves(args, lambda v: _NONE if v is None else v)


def _dec(args):
    """The inverse of :func:`_enc`."""
    return _map_leaves(args, lambda v: None if isinstance(v, _NoneArg) else v)


# ----------------------------------------------------------------------------- ops
# The nonstrict_trace functions must be registered with dynamo before it traces a call to them,
# and importing torch._dynamo costs ~2 s, which an eager-only program should not pay: they are
# made by _on_dynamo_loaded(), run when torch._dynamo is imported (by torch.compile) or at once
# if it already is.
_NODES: dict = {}
_FUNCS: list = []
_FUNC_INDEX: dict = {}


def _func_index(func) -> int:
    """A stable small int for ``func`` (evaluated natively: dynamo bakes the result in as a constant)."""
    i = _FUNC_INDEX.get(func)
    if i is None:
        _FUNCS.append(func)
        i = _FUNC_INDEX[func] = len(_FUNCS) - 1
    return i


def _symbolic_shape(value):
    """The first shape with a symbolic (dynamic) size among the tensors in ``value``, else None."""
    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", None)
        for t in (value,) if local is None else (value, local):
            if any(isinstance(d, torch.SymInt) for d in t.shape):
                return tuple(t.shape)
        return None
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (tuple, list)):
        return None
    for v in value:
        s = _symbolic_shape(v)
        if s is not None:
            return s
    return None


def _require_static(what, args, kwargs):
    """Refuse dynamic shapes with an error that names ``dynamic=False``.

    A layout's global shape is a compile-time constant (flatten context, sharding
    rules evaluated at trace time), so DTensor ops cannot be traced with symbolic
    sizes; dynamo makes shapes dynamic on its own when a compiled function meets a
    second input shape. Dynamo turns an exception raised here into a graph break
    ("Unsupported output type for nonstrict_trace-ed function"); the graph-break
    log (``TORCH_LOGS=graph_breaks``) quotes this message. Raising it from the code
    dynamo inlines instead did not stop the compile with it either (torch 2.13), so
    the user-facing error is still dynamo's; docs/performance_history.md (torch.compile) says to compile
    with ``dynamic=False`` (as ``examples/llama/train.py --compile`` does).
    """
    shape = _symbolic_shape((args, kwargs))
    if shape is not None:
        raise ValueError(
            f"hyper_parallel: {what} got a tensor with dynamic shape {shape} inside torch.compile; DTensor "
            "programs compile with static shapes only. Pass dynamic=False to torch.compile (e.g. "
            "torch.compile(block, dynamic=False)): a new input shape then recompiles instead")


def _op_node(index, args, kwargs):
    """Body of the opaque node of one DTensor op: the ordinary dispatcher, run natively."""
    _enter_compile_mode()
    _require_static(getattr(_FUNCS[index], "__name__", "a DTensor op"), args, kwargs)
    DTensor = _STATE["dtensor"]
    return _STATE["handler"](DTensor, _FUNCS[index], (DTensor,), _dec(args), _dec(kwargs))


def traced_op(func, args, kwargs):
    """``DTensor.__torch_function__`` while dynamo traces: one opaque node for the whole op."""
    return _NODES["op"](_NODES["index"](func), _enc(tuple(args)), _enc(dict(kwargs)) if kwargs else {})


_META_NAMES = frozenset({"_is_view", "is_contiguous", "stride", "storage_offset", "dim", "size", "numel",
                         "untyped_storage", "data_ptr", "_base", "layout", "is_nested", "__get__", "ndimension",
                         "nelement", "element_size", "get_device", "_typed_storage", "_version"})


def native_query(func, args, kwargs):
    """Metadata queries the compiler makes on a DTensor while tracing (``is_conj``, ``stride``...).

    They describe the wrapper itself (global shape, dtype, device, strides), so they
    run on it with subclass torch functions disabled. Returns ``NotImplemented`` for
    anything else (a real op: the dispatcher handles it).
    """
    _enter_compile_mode()
    name = getattr(func, "__name__", "")
    if name in _META_NAMES or name.startswith("is_") or name.startswith("_is_"):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    return NotImplemented


# ----------------------------------------------------------------------------- API methods
_API = ("from_local", "to_local", "redistribute", "full_tensor", "reduce_partial")
_API_ORIG: dict = {}


def _api_node(name):
    orig = _API_ORIG[name]

    def node(args, kwargs):
        _enter_compile_mode()
        _require_static(f"DTensor.{name}", args, kwargs)
        return orig(*_dec(args), **_dec(kwargs))
    node.__name__ = f"hp_dtensor_{name}"
    return node


def traceable_method(orig, name, static=False):
    """``orig`` with a dynamo branch: while dynamo traces, the call is one nonstrict_trace node."""
    from functools import wraps

    _API_ORIG[name] = orig

    @wraps(orig)
    def method(*args, **kwargs):
        if is_dynamo_compiling():
            return _NODES[name](_enc(args), _enc({k: v for k, v in kwargs.items() if v is not None}))
        return orig(*args, **kwargs)
    method.__wrapped_eager__ = orig
    return staticmethod(method) if static else method


# ----------------------------------------------------------------------------- eager hooks
def eager_hook(module_hook):
    """``module_hook`` that always runs eagerly, also when its module is compiled.

    ``torch.compile(module)`` runs the module's hooks as frames of their own, which
    dynamo would trace. FSDP's pre/post-forward hooks keep Python state (unshard,
    reshard, prefetch order, backward hooks), so they must stay eager while the block
    body compiles, as torch's FSDP2 does with ``torch._dynamo.disable``. Without
    dynamo loaded the hook is a plain call (no ``torch._dynamo`` import for eager
    programs); once it is loaded, this wrapper's frame is skipped by dynamo and the
    hook runs under ``torch._dynamo.disable``.
    """
    import functools

    disabled = []

    @functools.wraps(module_hook)
    def hook(*args, **kwargs):
        if not _STATE["dynamo_loaded"]:
            return module_hook(*args, **kwargs)
        if not disabled:
            disabled.append(torch._dynamo.disable(module_hook, recursive=True))
        return disabled[0](*args, **kwargs)
    return hook


_HOOK_CODE = eager_hook(lambda: None).__code__  # shared by every eager_hook wrapper: skipped by dynamo


def _on_dynamo_loaded():
    from torch._dynamo import assume_constant_result, nonstrict_trace
    from torch._dynamo.eval_frame import skip_code

    skip_code(_HOOK_CODE)

    _STATE["dynamo_loaded"] = True
    _NODES["index"] = assume_constant_result(_func_index)
    _NODES["op"] = nonstrict_trace(_op_node)
    for name in _API_ORIG:
        _NODES[name] = nonstrict_trace(_api_node(name))


class _DynamoImportHook:
    """A meta-path finder that runs :func:`_on_dynamo_loaded` right after ``torch._dynamo`` is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch._dynamo":
            return None
        import importlib.util
        import sys

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            _on_dynamo_loaded()
        spec.loader.exec_module = exec_module
        return spec


def _when_dynamo_loads():
    import sys

    if "torch._dynamo" in sys.modules and hasattr(sys.modules["torch._dynamo"], "nonstrict_trace"):
        _on_dynamo_loaded()
    else:
        sys.meta_path.insert(0, _DynamoImportHook())


# ----------------------------------------------------------------------------- compile mode
def _enter_compile_mode():
    """Put the op dispatcher in compile mode (once per process; see module docstring)."""
    _require_opaque()
    if _STATE["compile_mode"]:
        return
    _STATE["on_mode"]("compile")
    _STATE["compile_mode"] = True


def restore_eager_fast_paths():
    """Undo compile mode: reset dynamo's caches, then put the dispatcher back in eager mode.

    For tests and benchmarks that mix compiled and eager measurements in one
    process; compiled functions must be recompiled afterwards (dynamo is reset).
    """
    torch._dynamo.reset()
    if _STATE["compile_mode"]:
        _STATE["on_mode"]("eager")
    _STATE["compile_mode"] = False


def in_compile_mode() -> bool:
    return _STATE["compile_mode"]


def install(DTensor, handler, constant_classes, on_mode):
    """Make DTensor programs compilable (called once by the op dispatcher on import; the class is not touched).

    ``handler``: the eager ``__torch_function__`` implementation ``(cls, func, types, args, kwargs)``
    that the opaque op nodes run; ``constant_classes``: the layout/placement/mesh classes dynamo treats
    as compile-time constants; ``on_mode(mode)``: the dispatcher's mode switch ("compile" the first
    time dynamo meets a DTensor, "eager" from :func:`restore_eager_fast_paths`).
    """
    _STATE.update(dtensor=DTensor, handler=handler, on_mode=on_mode)
    _register_constants(tuple(constant_classes))
    _when_dynamo_loads()
