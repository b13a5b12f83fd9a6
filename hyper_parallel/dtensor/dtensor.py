"""DTensor: a framework tensor whose data is spread over a device mesh.

Design (why it is fast):

* A DTensor is a storage-less wrapper with the *global* shape, dtype and device
  around this rank's *local* tensor. Ops are intercepted at the
  ``__torch_function__`` level and run on the local tensors, so autograd records
  the local computation and the backward pass runs on plain tensors with no
  per-op DTensor work.
* Gradients follow PyTorch's convention: the gradient of a ``Shard`` tensor is
  sharded alike; the gradient of a ``Replicate`` or ``Partial`` tensor is held in
  full on every rank. ``from_local``/``to_local``/``redistribute``/``full_tensor``
  are differentiable with those gradient placements.
* ``requires_grad``, ``grad``, ``is_leaf``, ``grad_fn`` and ``data`` read and write
  the local tensor, so a DTensor works as an ``nn.Parameter`` and optimizers see
  DTensor gradients.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence, Tuple, Union, overload

from hyper_parallel.dtensor.device_mesh import DeviceMesh, resolve_mesh
from hyper_parallel.dtensor.mesh_semantics import semantics_of
from hyper_parallel.dtensor.layout import Alias, Layout, PlacementsLike, _rebuild_layout, is_alias_spelling
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard
from hyper_parallel.dtensor import strided_math
from hyper_parallel.dtensor import redistribute_plan as rp
from hyper_parallel.dtensor import strided_local
from hyper_parallel.dtensor.redistribute import CastRedistribute, GradRedistribute, partial_grad_view, run_plan
from hyper_parallel.dtensor.cross_mesh import cross_mesh_local
from hyper_parallel.dtensor.cache_key import Spec, spec_of  # noqa: F401  (the dispatcher's key token)
from hyper_parallel.dtensor.layout_builder import build_layout
from hyper_parallel.dtensor.grad_state import (_DG, _grad_layout, _set_partial_grad, _with_partial_over, is_partial_leaf,  # noqa: F401
                                                    grad_view, settle_pending_grads)
from hyper_parallel.dtensor.run_check import run_check as _run_check
from hyper_parallel.dtensor.local_meta import _global_stride, _off_mesh_local, _to_like  # noqa: F401
from hyper_parallel.dtensor.skip_and_replication import implicit_replication
from hyper_parallel.dtensor import special_methods as _special_methods
from hyper_parallel.dtensor.hp_module_names import _build_layout, _is_alias_placements, dtensor_module_getattr  # noqa: F401
from hyper_parallel.dtensor import torch_internals
import torch
from hyper_parallel.dtensor import vmap_bridge
from hyper_parallel.dtensor import fast_path
from hyper_parallel.compile import compile_mode

_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling  # held True by torch.compile for a whole compilation
_Size = torch.Size
_make_wrapper = _Tensor._make_wrapper_subclass
_STRIDED = torch.strided



def _dcp():
    """The DTensor hooks of torch.distributed.checkpoint (hyper_parallel/checkpoint/dcp.py), imported on first use."""
    from hyper_parallel.checkpoint import dcp
    return dcp


# ------------------------------------------------------------------ the op dispatcher
# DTensor's torch entry points are defined once, in the class below, and delegate to one dispatcher
# object: the op dispatcher of dispatch/dispatcher.py, handed over with set_dispatcher() when that
# module is imported (this module never imports it). Its mode (eager or compile) is its own state;
# what the class must look like in each mode is decided here, in set_mode(). docs/design.md, "The op path".
class _NoDispatcher:
    """The dispatcher until ``dispatch/dispatcher.py`` is imported: special methods only."""

    mode = "eager"

    @staticmethod
    def torch_function(cls, func, types, args=(), kwargs=None):
        special = SPECIAL_METHODS.get(func)
        if special is not None:
            return special(*args, **(kwargs or {}))
        raise NotImplementedError(
            f"{torch_internals.op_name(func)} on DTensor: op dispatch is not loaded; import hyper_parallel")

    @staticmethod
    def handle(func, types, args, kwargs):
        raise NotImplementedError(
            f"{torch_internals.op_name(func)} on DTensor: op dispatch is not loaded; import hyper_parallel")


_DISPATCHER = _NoDispatcher
_FAST_METHODS: dict = {}   # the fast methods (fast_path.py; name -> function), on the class except in compile mode
_EAGER_ONLY = ("size", "dim", "numel", "to", "float")  # overrides dynamo cannot inline: absent in compile mode
_TRACED: dict = {}         # API methods with their dynamo branch (compile mode), made below the class
_EAGER_ATTRS: dict = {}    # what set_mode("compile") took off the class, for set_mode("eager")


def set_dispatcher(dispatcher: Any) -> None:
    """Hand DTensor its op dispatcher (called once, by ``dispatch/dispatcher.py`` on import).

    ``dispatcher`` has ``torch_function(cls, func, types, args, kwargs)`` (what ``__torch_function__``
    calls) and ``handle(func, types, args, kwargs)`` (the slow path, for ``DTensor.to`` and the vmap
    bridge). The class itself does not change: its fast methods (``fast_path.py``) are defined when this
    module is imported and read the cache the dispatcher fills.
    """
    global _DISPATCHER
    for attr in ("torch_function", "handle"):
        if not callable(getattr(dispatcher, attr, None)):
            raise TypeError(f"set_dispatcher: dispatcher must have a callable {attr!r}, got {dispatcher!r}")
    _DISPATCHER = dispatcher


def set_mode(mode: str) -> None:
    """Shape the class for the dispatcher's mode (called by the dispatcher's ``set_mode`` only).

    "compile": dynamo refuses to call Tensor methods a subclass overrides, so the eager fast methods
    and the ``size``/``dim``/``numel``/``to``/``float`` overrides leave the class (those calls then take
    ``__torch_function__``: same results, ~1 us slower), and the API methods get their dynamo branch
    (one opaque node while dynamo traces). "eager": everything is put back.
    """
    if mode == "compile":
        if _EAGER_ATTRS:
            return
        for name in tuple(_FAST_METHODS) + _EAGER_ONLY:
            if name in DTensor.__dict__:
                _EAGER_ATTRS[name] = DTensor.__dict__[name]
                delattr(DTensor, name)
        for name, traced in _TRACED.items():
            _EAGER_ATTRS[name] = DTensor.__dict__[name]
            setattr(DTensor, name, traced)
    elif mode == "eager":
        for name, attr in _EAGER_ATTRS.items():
            setattr(DTensor, name, attr)
        _EAGER_ATTRS.clear()
    else:
        raise ValueError(f"set_mode: mode must be 'eager' or 'compile', got {mode!r}")


def register_special(func: Callable[..., Any], handler: Callable[..., Any]) -> Optional[Callable[..., Any]]:
    """Run ``handler(*args, **kwargs)`` instead of any sharding rule when ``func`` meets a DTensor.

    Returns the entry it replaces (None if there was none), for :func:`unregister_special`.
    """
    if not callable(handler):
        raise TypeError(f"register_special: handler must be callable, got {handler!r}")
    prev = SPECIAL_METHODS.get(func)
    SPECIAL_METHODS[func] = handler
    return prev


def unregister_special(func: Callable[..., Any], previous: Optional[Callable[..., Any]] = None) -> None:
    """Undo :func:`register_special`: restore ``previous`` (its return value) or drop the entry."""
    if previous is not None:
        SPECIAL_METHODS[func] = previous
    else:
        SPECIAL_METHODS.pop(func, None)


class DTensor(torch.Tensor):
    """Distributed tensor: global metadata plus this rank's local shard.

    Create one with :meth:`from_local`, :func:`distribute_tensor` or a factory
    (``ones``, ``randn``...). Placements may be given as objects, one per mesh dim
    (``[Shard(0), Replicate()]``), or as alias names, one per tensor dim
    (``("dp", "None")``, ``(("dp", "tp"), "None")``).
    """

    # slots: the per-op wrapper sets these five on every output, cheaper than __dict__ entries
    # (rare attributes - caches, Parameter flags - still go to the instance __dict__)
    __slots__ = ("_local_tensor", "_mesh", "_layout", "_gshape", "_spec")
    _local_tensor: torch.Tensor
    _mesh: DeviceMesh
    _layout: Layout
    _gshape: torch.Size
    _spec: Spec

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, device_mesh: Optional[DeviceMesh] = None,
                placements: Optional[PlacementsLike] = None, *, shape: Optional[Sequence[int]] = None,
                stride: Optional[Sequence[int]] = None) -> "DTensor":
        mesh = resolve_mesh(device_mesh, "DTensor")
        if placements is None:
            placements = [Replicate()] * mesh.ndim
        layout = build_layout(mesh, placements, local_tensor.dim())
        if shape is None:
            shape = layout.global_shape(tuple(local_tensor.shape))
        return cls._wrap(local_tensor, mesh, layout, tuple(shape), stride)

    @classmethod
    def _wrap(cls, local, mesh, layout, shape, stride=None):
        """Fast internal constructor: no validation."""
        # positional arguments (size, strides, storage_offset, memory_format, dtype, layout, device):
        # keyword parsing costs ~0.3 us on this per-op hot path
        r = _make_wrapper(cls, shape, stride, None, None, local.dtype, _STRIDED, local.device)
        r._local_tensor = local
        r._mesh = mesh
        r._layout = layout
        r._gshape = shape = shape if type(shape) is _Size else _Size(shape)
        r._spec = spec_of(layout, shape)
        if stride is not None:  # an explicit global stride (from_local): what stride() reports
            r.__dict__["_gstride"] = tuple(stride)
        return r

    # ------------------------------------------------------------------ metadata
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def placements(self) -> Tuple[Placement, ...]:
        return self._layout.placements

    @property
    def layout(self) -> Union[Layout, torch.layout]:  # type: ignore[override]  # the mesh decides (see below)
        """What ``.layout`` means depends on the mesh's semantics (docs/design.md, "DTensor.layout").

        On a HyperParallel mesh (``hyper_parallel.init_device_mesh``, HyperParallel's paths) it is the
        :class:`Layout` (mesh, placements, aliases, tensor map), as in HyperParallel. On a PyTorch mesh
        (``hyper_parallel.device_mesh.init_device_mesh``, a torch mesh, the swap) it is the memory layout
        ``torch.strided``, as for torch's DTensor and any dense tensor; so it is while ``torch.compile``
        runs (dynamo and AOTAutograd read it as the memory layout). The distribution layout is always
        :meth:`dist_layout`.
        """
        if self._mesh._hp_flag and not _compiling():
            return self._layout
        return _STRIDED

    def dist_layout(self) -> Layout:
        """The distribution :class:`Layout` (mesh, placements, aliases, tensor map), on any mesh."""
        return self._layout

    @property
    def alias_placements(self) -> Tuple[Alias, ...]:
        return self._layout.alias_placements

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]  # read-only: the global shape
        return self._gshape

    @overload
    def size(self, dim: None = None) -> torch.Size: ...

    @overload
    def size(self, dim: int) -> int: ...

    def size(self, dim: Optional[int] = None) -> Union[torch.Size, int]:
        return self._gshape if dim is None else self._gshape[dim]

    def numel(self) -> int:
        return self._gshape.numel()

    @property
    def ndim(self) -> int:  # type: ignore[override]  # read-only: the global rank
        return len(self._gshape)

    def dim(self) -> int:
        return len(self._gshape)

    @property
    def local_shape(self) -> torch.Size:
        return self._local_tensor.shape

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]  # read-only: the local tensor's
        return self._local_tensor.dtype

    @property
    def device(self) -> torch.device:  # type: ignore[override]  # read-only: the local tensor's
        return self._local_tensor.device

    # autograd state lives on the local tensor
    @property
    def requires_grad(self) -> bool:
        return self._local_tensor.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self._local_tensor.requires_grad_(value)
        _DG.mark_dtensor_leaf(self._local_tensor)

    @property
    def is_leaf(self) -> bool:  # type: ignore[override]  # read-only: the local tensor's
        return self._local_tensor.is_leaf

    @property
    def grad_fn(self) -> Optional[torch.autograd.graph.Node]:  # type: ignore[override]  # the local tensor's
        return self._local_tensor.grad_fn

    @property
    def grad(self) -> Optional["DTensor"]:
        """The gradient, a DTensor.

        As in PyTorch, a gradient that backward left partial (a replicated
        parameter applied to sharded activations, e.g. a norm weight under
        sequence parallelism) reports ``Partial`` on that mesh dim; no collective
        has run yet. Its first redistribution (the optimizer step,
        ``clip_grad_norm_``, ``full_tensor()``) sums all such gradients at once.
        """
        return grad_view(self)

    @grad.setter
    def grad(self, value: Optional[torch.Tensor]) -> None:
        _DG.forget(self._local_tensor)
        self.__dict__.pop("_grad_wrapper", None)  # the cached .grad view would keep the old gradient alive
        if value is None:
            self._local_tensor.grad = None
            self.__dict__.pop("_hp_partial_grad", None)
            return
        if not isinstance(value, DTensor):
            raise TypeError(f"DTensor.grad must be a DTensor (or None), got {type(value).__name__}")
        if self._layout.has_partial() and value._layout == self._layout:
            _set_partial_grad(self, value._local_tensor)
            return
        self.__dict__.pop("_hp_partial_grad", None)
        want = _grad_layout(self._layout)
        if value._layout != want:
            value = value.redistribute(self._mesh, want)
        self._local_tensor.grad = value._local_tensor

    def _hp_grad_reduced(self):
        """Called on a ``.grad`` view once its pending partial pieces were summed in place."""
        self.__dict__.pop("_hp_pending_grad", None)
        self.__dict__.pop("_redist_cache", None)
        self._layout = self._layout.without_partial()
        self._spec = spec_of(self._layout, self._gshape)

    def _settle_grad(self):
        """A pending partial ``.grad`` view about to be redistributed: sum all pending gradients first."""
        if self.__dict__.get("_hp_pending_grad"):
            _DG.flush_pending()

    @property
    def data(self) -> "DTensor":
        return DTensor._wrap(self._local_tensor.detach(), self._mesh, self._layout, self._gshape)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``x.data = y``: ``x`` takes ``y``'s values and metadata (layout, global shape,
        dtype, device), as a plain tensor does, and keeps its identity and that of its
        local tensor (an autograd leaf), so optimizers and hooks still hold it.
        ``nn.Module.to(dtype/device)`` converts DTensor parameters this way.
        """
        if not isinstance(value, DTensor):
            raise TypeError(f"DTensor.data must be a DTensor, got {type(value).__name__}; "
                            "wrap the value with distribute_tensor()/DTensor.from_local() first")
        if value._mesh != self._mesh:
            raise ValueError(f"DTensor.data: the new value lives on {value._mesh}, this DTensor on "
                             f"{self._mesh}; a DTensor cannot move between meshes")
        self._local_tensor.data = value._local_tensor
        torch_internals.set_wrapper_data(self, value)  # the wrapper's own dtype/device/shape
        self._layout, self._gshape, self._spec = value._layout, value._gshape, value._spec
        self.__dict__.pop("_redist_cache", None)
        self.__dict__.pop("_grad_wrapper", None)

    def __hash__(self):
        return id(self)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def from_local(local_tensor: torch.Tensor, device_mesh: Optional[DeviceMesh] = None,
                   placements: Optional[PlacementsLike] = None, *, run_check: bool = False,
                   shape: Optional[Sequence[int]] = None, stride: Optional[Sequence[int]] = None,
                   grad_placements: Optional[Sequence[Placement]] = None) -> "DTensor":
        """Wrap this rank's ``local_tensor`` as a DTensor (differentiable).

        ``shape``/``stride`` give the global metadata (both or neither, as in
        PyTorch); without them every shard is assumed to be the same size.
        ``run_check=True`` checks that dtype, requires_grad and the local shapes (and, without ``shape``, strides) of all
        ranks agree with each other and the layout, and broadcasts replicated data
        from the first rank of each replicated mesh dim. ``grad_placements`` says
        how ``local_tensor``'s gradient must be laid out (default: like the result's
        gradient); the gradient is redistributed to it in the backward pass.
        """
        if not isinstance(local_tensor, _Tensor):
            raise TypeError(f"DTensor.from_local: local_tensor must be a tensor, got {type(local_tensor).__name__}")
        if isinstance(local_tensor, DTensor):
            raise RuntimeError("DTensor.from_local: the local_tensor argument only accepts torch.Tensor (a plain "
                               f"tensor, each rank's piece), got {type(local_tensor).__name__}; a DTensor is already "
                               "distributed: use it directly, or .redistribute() / .to_local()")
        if (shape is None) != (stride is None):
            # as PyTorch: the global metadata comes whole or is derived whole from even shards
            raise RuntimeError(f"DTensor.from_local: found shape={None if shape is None else tuple(shape)}, "
                               f"stride={None if stride is None else tuple(stride)}. Please pass both shape and "
                               "stride at the same time (for a contiguous global tensor of shape s, stride is "
                               "torch.empty(s, device='meta').stride()).")
        mesh = resolve_mesh(device_mesh, "DTensor.from_local")
        if placements is None:
            placements = [Replicate()] * mesh.ndim
        layout = build_layout(mesh, placements, local_tensor.dim())
        if shape is None:
            gshape = layout.global_shape(tuple(local_tensor.shape))
        else:
            gshape = tuple(shape)
            if len(gshape) != local_tensor.dim():
                raise ValueError(f"DTensor.from_local: shape {gshape} has {len(gshape)} dims but the local tensor "
                                 f"has {local_tensor.dim()}")
            # with run_check the shape check is collective (_run_check): a rank raising here
            # alone would leave the others waiting in it
            expect = layout.local_shape(gshape, coord=mesh.get_coordinate()) if mesh._coord is not None else None
            if not run_check and expect is not None and expect != tuple(local_tensor.shape):
                raise ValueError(f"DTensor.from_local: local tensor shape {tuple(local_tensor.shape)} on rank "
                                 f"{mesh.get_rank()} does not match shape={gshape} with placements "
                                 f"{layout.placements} (expected local shape {expect})")
        _check_strided_label(placements, layout, gshape, "DTensor.from_local")
        if stride is None and shape is None and not local_tensor.is_contiguous():
            stride = _global_stride(local_tensor, mesh, layout)
        if mesh._coord is None:
            # a rank outside the mesh holds nothing (PyTorch semantics): global metadata only
            return DTensor._wrap(_off_mesh_local(local_tensor), mesh, layout, gshape, stride)
        if run_check:
            local_tensor = _run_check(local_tensor, mesh, layout, gshape, check_stride=shape is None)
        if is_partial_leaf(local_tensor, layout):
            # a leaf piece wrapped as a DTensor is not the DTensor's leaf (PyTorch: from_local's output is
            # not a leaf): the piece keeps the reduction's adjoint gradient, a Partial leaf DTensor the full one
            local_tensor = local_tensor.view_as(local_tensor)
        if grad_placements is not None and local_tensor.requires_grad:
            gl = build_layout(mesh, grad_placements, local_tensor.dim(), "grad_placements")
            want = _grad_layout(layout)
            if gl != want:
                plan = rp.plan(want, gl, tuple(gshape), local_tensor.element_size())
                local_tensor = GradRedistribute.apply(local_tensor, plan, mesh, mesh._rank_index())
        return DTensor._wrap(local_tensor, mesh, layout, gshape, stride)

    def to_local(self, *, grad_placements: Optional[Sequence[Placement]] = None) -> torch.Tensor:
        """This rank's shard (differentiable).

        ``grad_placements`` says how the gradient of the returned tensor is laid
        out (default: like this DTensor, Partial read as Replicate); it is
        redistributed to this DTensor's gradient layout in the backward pass.
        """
        if grad_placements is None:
            return self._local_tensor
        gl = build_layout(self._mesh, grad_placements, self.ndim, "grad_placements")
        want = _grad_layout(self._layout)
        if gl == want or not self._local_tensor.requires_grad:
            return self._local_tensor
        if gl.without_partial() == want and all(op in (None, "sum") for op in gl.partial):
            # only pending sums on top of the gradient layout: sum them where they meet the
            # producer (a reduce_scatter into an all_gather's source, as PyTorch does)
            local = self._local_tensor
            for d, op in enumerate(gl.partial):
                if op is not None:
                    local = partial_grad_view(local, self._mesh.get_comm_group(d), leave_partial=False)
            return local
        plan = rp.plan(gl, want, tuple(self._gshape), self._local_tensor.element_size())
        return GradRedistribute.apply(self._local_tensor, plan, self._mesh, self._mesh._rank_index())

    def redistribute(self, device_mesh: Union[DeviceMesh, Layout, None] = None,
                     placements: Optional[PlacementsLike] = None, *, async_op: bool = False,
                     forward_dtype: Optional[torch.dtype] = None,
                     backward_dtype: Optional[torch.dtype] = None) -> "DTensor":
        """Return this tensor laid out as ``placements`` (differentiable; cheapest plan).

        HyperParallel's form ``redistribute(dst_layout)`` takes a tensor ``Layout`` (mesh and
        placements in one, ``Partial`` included) as the only argument.

        ``device_mesh`` may be another mesh (other ranks or another shape): the
        overlapping pieces then move point to point (see ``docs/dtensor.md``,
        "Cross-mesh redistribution").

        ``async_op`` is accepted for PyTorch compatibility, but the collectives
        always run synchronously: the result is complete when this returns (a
        valid implementation of the asynchronous contract, which only promises
        that the data is ready by the time it is used).

        As in PyTorch, ``forward_dtype`` casts the local data before the forward
        collectives (the result has that dtype), and ``backward_dtype`` is the dtype
        the gradient's collectives run in; the gradient reaching this tensor has its
        dtype either way.
        """
        if isinstance(device_mesh, Layout):
            # HyperParallel's form, ``x.redistribute(dst_layout)``: a tensor Layout carries mesh and placements
            if placements is not None:
                raise TypeError("redistribute(layout): a Layout already carries the placements; got placements="
                                f"{placements!r} too")
            if device_mesh.dim_map is None:
                raise ValueError(f"redistribute({device_mesh!r}): a device-matrix Layout has no tensor map; call "
                                 "it with one alias per tensor dim first, e.g. layout('dp', 'None')")
            return self._redistribute(device_mesh.mesh, device_mesh, forward_dtype=forward_dtype,
                                      backward_dtype=backward_dtype)
        if device_mesh is not None:
            device_mesh = resolve_mesh(device_mesh, "redistribute")  # a torch mesh is adopted first
        same_mesh = device_mesh is None or device_mesh is self._mesh or device_mesh == self._mesh
        target_mesh = self._mesh if device_mesh is None else device_mesh
        placements = semantics_of(target_mesh).trim_placements(target_mesh, placements, "redistribute")
        if same_mesh and isinstance(placements, (list, tuple)) and not is_alias_spelling(placements):
            # as PyTorch: a Partial target only where the tensor already has that Partial (moving to
            # another mesh, our extension, may create one)
            src = self.placements
            for d, p in enumerate(placements):
                if isinstance(p, Partial) and (d >= len(src) or src[d] != p):
                    have = src[d] if d < len(src) else None
                    raise RuntimeError(f"Can not redistribute from {have} to {p}, redistributing to Partial is for "
                                       f"internal use only! (placements[{d}] = {p!r} on mesh dim {d}; a Partial "
                                       "value comes from an op, e.g. a matmul of sharded inputs)")
        return self._redistribute(device_mesh, placements, forward_dtype=forward_dtype,
                                  backward_dtype=backward_dtype)

    def _redistribute(self, device_mesh=None, placements=None, *, forward_dtype=None,
                      backward_dtype=None) -> "DTensor":
        """``redistribute`` without the public check on Partial targets.

        Any target works, ``Partial`` included (the value is kept: the first rank of
        each partial mesh dim holds it, the others the reduction's identity); the
        library's own code and the exhaustive parity tests use it.
        """
        if self._layout.has_partial():
            self._settle_grad()
        if forward_dtype is not None or backward_dtype is not None:
            return self._redistribute_cast(device_mesh, placements, forward_dtype, backward_dtype)
        mesh = resolve_mesh(device_mesh, "redistribute") if device_mesh is not None else self._mesh
        if placements is None:
            placements = [Replicate()] * mesh.ndim
        dst = build_layout(mesh, placements, self.ndim)
        _check_strided_label(placements, dst, self._gshape, "redistribute")
        if mesh is not self._mesh and mesh != self._mesh:
            # another mesh (other ranks or shape): point-to-point moves of the overlapping pieces
            return DTensor._wrap(cross_mesh_local(self, mesh, dst), mesh, dst, self._gshape)
        if dst == self._layout:
            return self
        if mesh._coord is None:  # outside the mesh: no data, no collective
            return DTensor._wrap(self._local_tensor, self._mesh, dst, self._gshape)
        local = self._redistribute_local(dst)
        return DTensor._wrap(local, self._mesh, dst, self._gshape)

    def _redistribute_cast(self, device_mesh, placements, forward_dtype, backward_dtype) -> "DTensor":
        """``redistribute`` with ``forward_dtype``/``backward_dtype`` (see there)."""
        mesh = resolve_mesh(device_mesh, "redistribute") if device_mesh is not None else self._mesh
        if mesh != self._mesh:
            raise ValueError(f"redistribute: target mesh {mesh} differs from the source mesh {self._mesh}; "
                             "redistributing across meshes is not supported")
        if placements is None:
            placements = [Replicate()] * mesh.ndim
        dst = build_layout(mesh, placements, self.ndim)
        local = self._local_tensor
        in_dtype = local.dtype
        fwd = forward_dtype if forward_dtype is not None else in_dtype
        bwd = backward_dtype if backward_dtype is not None else in_dtype
        if mesh._coord is None:  # outside the mesh: no data, no collective
            return DTensor._wrap(local.to(fwd), self._mesh, dst, self._gshape)
        shape = tuple(self._gshape)
        fplan = rp.plan(self._layout, dst, shape, torch_internals.element_size(fwd))
        bplan = rp.plan(_grad_layout(dst), _grad_layout(self._layout), shape, torch_internals.element_size(bwd))
        out = CastRedistribute.apply(local, fplan, bplan, self._mesh, self._mesh._rank_index(), fwd, bwd)
        return DTensor._wrap(out, self._mesh, dst, self._gshape)

    def _redistribute_local(self, dst: Layout):
        """This tensor's local data laid out as ``dst``.

        Results are memoised on this DTensor (keyed by target layout, grad mode and
        the local tensor's version counter), so sibling consumers of one activation
        (wq/wk/wv, w1/w3) share one collective forward and one in backward.
        """
        if self._layout.has_partial():
            self._settle_grad()
            if dst == self._layout:
                return self._local_tensor
        local = self._local_tensor
        # inference tensors have no version counter: an in-place change would go unseen, so no memo
        memo = not local.is_inference()
        if memo:
            key = (dst, torch.is_grad_enabled(), local._version)
            cache: Optional[dict] = self.__dict__.get("_redist_cache")
            if cache is None:
                cache = self.__dict__["_redist_cache"] = {}
            hit = cache.get(key)
            if hit is not None:
                return hit
        if self._layout.is_strided or dst.is_strided:
            out = _strided_redistribute(local, self._layout, dst, tuple(self._gshape), self._mesh)
        elif is_partial_leaf(local, self._layout):
            # torch's convention for a Partial(avg/max/min) leaf: its gradient is the full one, Replicate
            # (the adjoint of the reduction would leave each rank its piece's share)
            plan = rp.plan(self._layout, dst, tuple(self._gshape), local.element_size())
            bplan = rp.plan(_grad_layout(dst), _grad_layout(self._layout), tuple(self._gshape),
                            local.element_size())
            out = CastRedistribute.apply(local, plan, bplan, self._mesh, self._mesh._rank_index(),
                                         local.dtype, local.dtype)
        else:
            plan = rp.plan(self._layout, dst, tuple(self._gshape), local.element_size())
            out = run_plan(local, plan, self._mesh, self._mesh._rank_index())
        if memo and cache is not None:
            if len(cache) > 4:
                cache.clear()
            cache[key] = out
        return out

    def reduce_partial(self) -> "DTensor":
        """Resolve pending ``Partial`` placements to ``Replicate`` (no-op without any; HyperParallel's name)."""
        if not self._layout.has_partial():
            return self
        return self.redistribute(self._mesh, self._layout.without_partial())

    def full_tensor(self, *, grad_placements: Optional[Sequence[Placement]] = None) -> torch.Tensor:
        """The whole tensor on every rank (differentiable; all-gathers/all-reduces as needed).

        On a rank outside the mesh it is that rank's empty local tensor (as in PyTorch).
        """
        if self._mesh._coord is None:
            return self._local_tensor
        rep = self._layout.replicated()
        out = self if rep == self._layout else DTensor._wrap(self._redistribute_local(rep), self._mesh, rep,
                                                             self._gshape)
        return out.to_local(grad_placements=grad_placements)

    # ------------------------------------------------------------------ conversions
    def to(self, *args: Any, **kwargs: Any) -> "DTensor":
        if (args and isinstance(args[0], _Tensor)) or "other" in kwargs:
            args, kwargs = _to_like(args, kwargs)  # x.to(other): other's device and dtype (DTensor or plain)
        if self._layout.has_partial():
            self._settle_grad()  # a pending .grad view becomes Replicate here
        if self._layout.has_partial() and _DISPATCHER is not _NoDispatcher:
            # casting each pending partial piece is not casting their sum (int/bool targets): let the
            # op rule decide whether the partial must be reduced first
            return _DISPATCHER.handle(_Tensor.to, (DTensor,), (self,) + args, kwargs)
        return DTensor._wrap(self._local_tensor.to(*args, **kwargs), self._mesh, self._layout, self._gshape)

    def float(self) -> "DTensor":
        return self.to(torch.float32)

    def __repr__(self):
        return (f"DTensor(local_tensor={self._local_tensor!r}, device_mesh={self._mesh!r}, "
                f"placements={self._layout.placements}, shape={tuple(self._gshape)})")

    __str__ = __repr__

    def __format__(self, spec):
        return repr(self)

    # ------------------------------------------------------------------ interception
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Every op on a DTensor enters here and goes to the op dispatcher (eager or compile mode)."""
        return _DISPATCHER.torch_function(cls, func, types, args, kwargs)

    # torch.compile: a traceable wrapper subclass (the local tensor is the one inner tensor)
    def __tensor_flatten__(self):
        return ["_local_tensor"], (self._mesh, self._layout, tuple(self._gshape))

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return compile_mode.tensor_unflatten(DTensor, inner_tensors, meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Ops are handled in __torch_function__; reaching here means some code path
        # bypassed it (e.g. a C++ utility receiving the wrapper directly), or torch.compile's meta
        # converter detaching a fake input (answered by compile_mode.fake_detach).
        fake = compile_mode.fake_detach(DTensor, func, args)
        if fake is not None:
            return fake
        if torch_internals.functorch_active():
            # torch.vmap: a batching rule sends an aten op; run its torch-level twin through the
            # normal DTensor dispatch (plain tensors the rule makes, e.g. index offsets, are global)
            twin = vmap_bridge.translate(func, args)
            cause = None
            if twin is not None and _DISPATCHER is not _NoDispatcher:
                try:
                    with implicit_replication():
                        return _DISPATCHER.handle(twin[0], types, twin[1], kwargs or {})
                except (TypeError, NotImplementedError) as e:  # no rule / another signature
                    cause = e
            raise RuntimeError(
                f"torch.vmap (or another torch.func transform) over a DTensor: hyper_parallel cannot run {func} "
                f"on DTensors under the transform ({cause or 'no DTensor rule for it'}). Simple programs "
                "(elementwise ops, reductions, views, embedding) work; otherwise apply the transform to the local "
                "tensors (e.g. inside local_map, or on dtensor.to_local())") from cause
        raise RuntimeError(
            f"{func} reached a DTensor below __torch_function__; this path is not supported. "
            "Call it on dtensor.to_local() or dtensor.full_tensor() instead")

    def __reduce_ex__(self, protocol):
        """Pickle (``torch.save``, ``copy.copy``) this rank's shard with its mesh, layout and global shape.

        As ``torch.distributed.tensor``: each rank saves its own part; loading needs
        the mesh's process groups in the loading process (see ``_rebuild_mesh``).
        The rebuild functions are registered as safe for ``torch.load(weights_only=True)``.
        """
        return (_rebuild_dtensor, (self._local_tensor, self._mesh, self._layout, tuple(self._gshape),
                                   bool(self.__dict__.get("_is_param", False))))

    # ------------------------------------------------------------------ distributed checkpoint hooks
    # (answers in hyper_parallel/checkpoint/dcp.py, imported on first use: DCP is a heavy import)
    # torch.distributed.checkpoint asks tensor-likes for their boxes through these; the
    def __create_write_items__(self, fqn, obj):
        return _dcp().create_write_items(fqn, self)

    def __create_chunk_list__(self):
        return _dcp().create_chunk_list(self)

    def __get_tensor_shard__(self, index):
        return _dcp().get_tensor_shard(self, index)

    def __hp_stage__(self, copy_local):
        """This DTensor with its local tensor copied by ``copy_local`` (DCP's async_save staging)."""
        return DTensor._wrap(copy_local(self._local_tensor), self._mesh, self._layout, self._gshape)

    def __deepcopy__(self, memo):
        local = copy.deepcopy(self._local_tensor, memo)
        _DG.mark_dtensor_leaf(local)
        out = DTensor._wrap(local, self._mesh, self._layout, self._gshape)
        if getattr(self, "_is_param", False):
            out._is_param = True
        memo[id(self)] = out
        return out


def _check_strided_label(placements, layout: Layout, gshape, what: str) -> None:
    """Explicit ``_StridedShard`` placements: refuse uneven shapes where torch's reading differs from ours."""
    if isinstance(placements, (list, tuple)) and any(type(p) is _StridedShard for p in placements):
        strided_math.check_torch_pieces(layout, tuple(gshape), what)


def _strided_redistribute(local, src: Layout, dst: Layout, gshape, mesh):
    """Redistribution from or to a residual ``_StridedShard`` layout: through the full tensor, as PyTorch."""
    if src.is_strided:
        local = strided_local.gather_strided(local, src, gshape, mesh)
        src = src._derive(((),) * len(gshape), src.partial)
    if dst.is_strided:
        rep = dst._derive(((),) * len(gshape), (None,) * len(dst.mesh_shape))
        if dst.has_partial():
            raise NotImplementedError(f"redistribute: a target with _StridedShard and Partial placements "
                                      f"({dst.placements}) is not supported; redistribute to Shard/Replicate")
        if src != rep:
            local = run_plan(local, rp.plan(src, rep, gshape, local.element_size()), mesh, mesh._rank_index())
        return strided_local.slice_strided(local, dst, mesh.get_coordinate())
    if src == dst:
        return local
    return run_plan(local, rp.plan(src, dst, gshape, local.element_size()), mesh, mesh._rank_index())


def _rebuild_dtensor(local, mesh, layout, shape, is_param=False):
    """Unpickle a DTensor saved by :meth:`DTensor.__reduce_ex__`."""
    if not isinstance(mesh, DeviceMesh) or not isinstance(layout, Layout):
        raise TypeError(f"loading a DTensor: expected a DeviceMesh and a Layout, got {type(mesh).__name__} "
                        f"and {type(layout).__name__}")
    if layout.rank_list != mesh.rank_list or tuple(layout.mesh_shape) != tuple(mesh.shape):
        raise ValueError(f"loading a DTensor: its layout {layout} does not match its mesh {mesh}")
    out = DTensor._wrap(local, mesh, layout, torch.Size(shape))
    _DG.mark_dtensor_leaf(local)
    if is_param:
        out._is_param = True
    return out


# what a pickled DTensor refers to (the mesh registers its own rebuild function)
torch.serialization.add_safe_globals([_rebuild_dtensor, _rebuild_layout, Shard, Replicate, Partial])


# ------------------------------------------------------------------ fast methods
# Python-level fast paths of common Tensor methods (dtensor/fast_path.py), part of the class from the start.
# Only compile mode takes them off (set_mode): dynamo graph-breaks on Tensor methods a subclass overrides.
_FAST_METHODS.update(fast_path.make_methods(DTensor))
for _name, _method in _FAST_METHODS.items():
    setattr(DTensor, _name, _method)
del _name, _method


# ------------------------------------------------------------------ special-cased methods
# func -> implementation, looked up before any sharding rule (dtensor/special_methods.py);
# other layers add entries with register_special()
SPECIAL_METHODS = _special_methods.build_table(DTensor)


# torch.compile: the API methods' dynamo branch (one opaque node while dynamo traces). from_local carries it
# always (it can be a compiled region's first DTensor call, on plain inputs); the others get it in compile mode
# (set_mode), so eager calls pay nothing.
DTensor.from_local = compile_mode.traceable_method(  # type: ignore[method-assign]
    DTensor.__dict__["from_local"].__func__, "from_local", static=True)
_TRACED.update({name: compile_mode.traceable_method(DTensor.__dict__[name], name)
                for name in ("to_local", "redistribute", "full_tensor", "reduce_partial")})


__all__ = ["DTensor", "build_layout", "set_dispatcher", "set_mode", "register_special", "unregister_special",
           "settle_pending_grads"]


def __getattr__(name):
    # HyperParallel's names kept in this module there (distribute_tensor, SkipDTensorDispatch...)
    return dtensor_module_getattr(__name__, name)
