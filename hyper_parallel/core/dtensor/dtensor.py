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

import sys
import weakref
from typing import Optional, Sequence

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, resolve_mesh, uses_hp_semantics
from hyper_parallel.core.dtensor.hp_placements import drop_extra_placements
from hyper_parallel.core.dtensor.layout import Layout, _rebuild_layout, is_alias_spelling
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.core.dtensor import redistribute_plan as rp
from hyper_parallel.core.dtensor.redistribute import GradRedistribute, run_plan
from hyper_parallel.core.dtensor.cross_mesh import cross_mesh_local
from hyper_parallel.platform import get_platform

platform = get_platform()
_Tensor = platform.Tensor
_Size = platform.Size
_make_wrapper = _Tensor._make_wrapper_subclass
_STRIDED = platform.strided
_DG = platform.deferred_grads  # partial gradients left pending after backward (see DTensor.grad)

_getframe = sys._getframe
_FRAMEWORK_PKG = platform.framework_package  # "torch"
_FRAMEWORK_PREFIX = _FRAMEWORK_PKG + "."


def _caller_is_framework(frame) -> bool:
    """Whether ``frame`` runs code of the framework package itself (not user or hyper_parallel code)."""
    name = frame.f_globals.get("__name__", "")
    return bool(_FRAMEWORK_PKG) and (name.startswith(_FRAMEWORK_PREFIX) or name == _FRAMEWORK_PKG)


# Installed by hyper_parallel.core.shard._op_dispatch (a higher layer) on import.
_OP_HANDLER = None


class Spec:
    """The interned (layout, global shape) pair of a DTensor: the dispatcher's cache-key token.

    One object per distinct pair (see :func:`spec_of`), hashed and compared by
    identity, which the interpreter does in C: a key built from specs costs no
    Python-level ``Layout.__hash__`` call, and a spec never equals a scalar
    argument that shares the key.
    """

    __slots__ = ("layout", "shape")

    def __init__(self, layout, shape):
        self.layout, self.shape = layout, shape

    def __repr__(self):
        return f"Spec({self.layout}, {tuple(self.shape)})"


_SPECS: dict = {}
_SPECS_MAX = 65536


def spec_of(layout, shape) -> Spec:
    """The interned :class:`Spec` of ``(layout, shape)``.

    The table is bounded: when full it starts afresh, after which equal pairs may
    get a new token (a dispatcher cache miss, never a wrong hit: a token is never
    reused for another pair).
    """
    key = (layout, shape)
    s = _SPECS.get(key)
    if s is None:
        if len(_SPECS) >= _SPECS_MAX:
            _SPECS.clear()
        s = _SPECS[key] = Spec(layout, shape)
    return s


_LAYOUT_CACHE = {}


def build_layout(mesh: DeviceMesh, placements, ndim: int, what: str = "placements") -> Layout:
    """Layout for an ``ndim``-d tensor from placement objects or alias names (cached)."""
    if isinstance(placements, Layout):
        return placements
    try:
        key = (mesh, tuple(placements), ndim)
        if len(key[1]) > mesh.ndim:  # too long: the answer depends on the mesh's semantics (hp_placements)
            key += (uses_hp_semantics(mesh),)
        hit = _LAYOUT_CACHE.get(key)
    except TypeError:
        raise TypeError(f"{what}: expected a sequence of Placement objects or alias names, got {placements!r}") from None
    if hit is not None:
        return hit
    base = mesh._base_layout if hasattr(mesh, "_base_layout") else None
    if base is None:
        base = Layout.from_device_mesh(mesh)
        mesh._base_layout = base
    placements = tuple(drop_extra_placements(mesh, placements, what))  # HyperParallel meshes: extras ignored
    if is_alias_spelling(placements):
        if mesh.mesh_dim_names is None:
            raise ValueError(f"{what}: alias names {placements} need a mesh with mesh_dim_names")
        if len(placements) != ndim:
            raise ValueError(f"{what}: alias placements {placements} have {len(placements)} entries but the tensor "
                             f"has {ndim} dims; give one alias per tensor dim")
        layout = base.with_aliases(placements)
    else:
        has_alias = any(isinstance(p, (str, tuple)) for p in placements)
        if has_alias and any(isinstance(p, Partial) for p in placements):
            raise ValueError(f"{what}: Partial cannot be written as an alias ({placements!r}); pass placement "
                             "objects, one per mesh dim, e.g. [Partial(), Replicate()]")
        for i, p in enumerate(placements):
            if not isinstance(p, Placement):
                if isinstance(p, str) or (isinstance(p, tuple) and p and isinstance(p[0], str)):
                    raise TypeError(f"{what}: do not mix alias names and placement objects ({placements!r})")
                raise TypeError(f"{what}[{i}] = {p!r} is not a Placement (Shard, Replicate, Partial) or alias name")
        layout = base.with_placements(placements, ndim)
    _LAYOUT_CACHE[key] = layout
    return layout


def _grad_layout(layout: Layout) -> Layout:
    return layout.without_partial() if layout.has_partial() else layout


class DTensor(platform.DTensorBase):
    """Distributed tensor: global metadata plus this rank's local shard.

    Create one with :meth:`from_local`, :func:`distribute_tensor` or a factory
    (``ones``, ``randn``...). Placements may be given as objects, one per mesh dim
    (``[Shard(0), Replicate()]``), or as alias names, one per tensor dim
    (``("dp", "None")``, ``(("dp", "tp"), "None")``).
    """

    # slots: the per-op wrapper sets these five on every output, cheaper than __dict__ entries
    # (rare attributes - caches, Parameter flags - still go to the instance __dict__)
    __slots__ = ("_local_tensor", "_mesh", "_layout", "_gshape", "_spec")

    @staticmethod
    def __new__(cls, local_tensor, device_mesh: DeviceMesh = None, placements=None, *, shape=None, stride=None):
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
    def placements(self):
        return self._layout.placements

    @property
    def layout(self) -> Layout:
        """The :class:`Layout` (mesh, placements, aliases, tensor map) of this DTensor.

        Read from inside the framework's own Python code (``torch.testing``,
        serialization...) it is the framework's memory layout (``torch.strided``), as
        for any dense tensor; see docs/design.md, "DTensor.layout".
        """
        if _caller_is_framework(_getframe(1)):
            return _STRIDED
        return self._layout

    @property
    def alias_placements(self):
        return self._layout.alias_placements

    @property
    def shape(self):
        return self._gshape

    def size(self, dim: Optional[int] = None):
        return self._gshape if dim is None else self._gshape[dim]

    def numel(self) -> int:
        return self._gshape.numel()

    @property
    def ndim(self) -> int:
        return len(self._gshape)

    def dim(self) -> int:
        return len(self._gshape)

    @property
    def local_shape(self):
        return self._local_tensor.shape

    @property
    def dtype(self):
        return self._local_tensor.dtype

    @property
    def device(self):
        return self._local_tensor.device

    # autograd state lives on the local tensor
    @property
    def requires_grad(self) -> bool:
        return self._local_tensor.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool):
        self._local_tensor.requires_grad_(value)
        _DG.mark_dtensor_leaf(self._local_tensor)

    @property
    def is_leaf(self) -> bool:
        return self._local_tensor.is_leaf

    @property
    def grad_fn(self):
        return self._local_tensor.grad_fn

    @property
    def grad(self):
        """The gradient, a DTensor.

        As in PyTorch, a gradient that backward left partial (a replicated
        parameter applied to sharded activations, e.g. a norm weight under
        sequence parallelism) reports ``Partial`` on that mesh dim; no collective
        has run yet. Its first redistribution (the optimizer step,
        ``clip_grad_norm_``, ``full_tensor()``) sums all such gradients at once.
        """
        local = self._local_tensor
        g = local.grad
        if g is None:
            return None
        cached = self.__dict__.get("_grad_wrapper")
        if cached is not None and cached._local_tensor is g:
            return cached
        lay = self._layout if self.__dict__.get("_hp_partial_grad") else _grad_layout(self._layout)
        group = _DG.partial_group(local) if _DG.has_pending() else None
        if group is not None:
            lay = _with_partial_over(lay, self._mesh, group)
            if lay is None:  # the group is not a dim of this mesh: sum now
                _DG.flush_pending()
                lay = _grad_layout(self._layout)
        w = DTensor._wrap(g, self._mesh, lay, self._gshape)
        if group is not None and lay.has_partial():
            w.__dict__["_hp_pending_grad"] = True
            _DG.note_view(local, w)
        self.__dict__["_grad_wrapper"] = w
        return w

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

    @grad.setter
    def grad(self, value):
        _DG.forget(self._local_tensor)
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

    @property
    def data(self):
        return DTensor._wrap(self._local_tensor.detach(), self._mesh, self._layout, self._gshape)

    @data.setter
    def data(self, value):
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
        platform.set_wrapper_data(self, value)  # the wrapper's own dtype/device/shape
        self._layout, self._gshape, self._spec = value._layout, value._gshape, value._spec
        self.__dict__.pop("_redist_cache", None)
        self.__dict__.pop("_grad_wrapper", None)

    def __hash__(self):
        return id(self)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def from_local(local_tensor, device_mesh: DeviceMesh = None, placements=None, *, run_check: bool = False,
                   shape=None, stride=None, grad_placements: Optional[Sequence[Placement]] = None) -> "DTensor":
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
        if stride is None and shape is None and not local_tensor.is_contiguous():
            stride = _global_stride(local_tensor, mesh, layout)
        if mesh._coord is None:
            # a rank outside the mesh holds nothing (PyTorch semantics): global metadata only
            return DTensor._wrap(_off_mesh_local(local_tensor), mesh, layout, gshape, stride)
        if run_check:
            local_tensor = _run_check(local_tensor, mesh, layout, gshape, check_stride=shape is None)
        if grad_placements is not None and local_tensor.requires_grad:
            gl = build_layout(mesh, grad_placements, local_tensor.dim(), "grad_placements")
            want = _grad_layout(layout)
            if gl != want:
                plan = rp.plan(want, gl, tuple(gshape), local_tensor.element_size())
                local_tensor = GradRedistribute.apply(local_tensor, plan, mesh, mesh._rank_index())
        return DTensor._wrap(local_tensor, mesh, layout, gshape, stride)

    def to_local(self, *, grad_placements: Optional[Sequence[Placement]] = None):
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
            from hyper_parallel.core.dtensor.redistribute import partial_grad_view
            local = self._local_tensor
            for d, op in enumerate(gl.partial):
                if op is not None:
                    local = partial_grad_view(local, self._mesh.get_comm_group(d), leave_partial=False)
            return local
        plan = rp.plan(gl, want, tuple(self._gshape), self._local_tensor.element_size())
        return GradRedistribute.apply(self._local_tensor, plan, self._mesh, self._mesh._rank_index())

    def redistribute(self, device_mesh: DeviceMesh = None, placements=None, *, async_op: bool = False,
                     forward_dtype=None, backward_dtype=None) -> "DTensor":
        """Return this tensor laid out as ``placements`` (differentiable; cheapest plan).

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
        if device_mesh is not None:
            device_mesh = resolve_mesh(device_mesh, "redistribute")  # a torch mesh is adopted first
        same_mesh = device_mesh is None or device_mesh is self._mesh or device_mesh == self._mesh
        placements = drop_extra_placements(self._mesh if device_mesh is None else device_mesh, placements,
                                           "redistribute")
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
        from hyper_parallel.core.dtensor.redistribute import CastRedistribute
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
        fplan = rp.plan(self._layout, dst, shape, platform.element_size(fwd))
        bplan = rp.plan(_grad_layout(dst), _grad_layout(self._layout), shape, platform.element_size(bwd))
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
            key = (dst, platform.grad_enabled(), local._version)
            cache = self.__dict__.get("_redist_cache")
            if cache is None:
                cache = self.__dict__["_redist_cache"] = {}
            hit = cache.get(key)
            if hit is not None:
                return hit
        plan = rp.plan(self._layout, dst, tuple(self._gshape), local.element_size())
        out = run_plan(local, plan, self._mesh, self._mesh._rank_index())
        if memo:
            if len(cache) > 4:
                cache.clear()
            cache[key] = out
        return out

    def reduce_partial(self) -> "DTensor":
        """Resolve pending ``Partial`` placements to ``Replicate`` (no-op without any; HyperParallel's name)."""
        if not self._layout.has_partial():
            return self
        return self.redistribute(self._mesh, self._layout.without_partial())

    def full_tensor(self, *, grad_placements: Optional[Sequence[Placement]] = None):
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
    def to(self, *args, **kwargs) -> "DTensor":
        if (args and isinstance(args[0], _Tensor)) or "other" in kwargs:
            args, kwargs = _to_like(args, kwargs)  # x.to(other): other's device and dtype (DTensor or plain)
        if self._layout.has_partial():
            self._settle_grad()  # a pending .grad view becomes Replicate here
        if self._layout.has_partial() and _OP_HANDLER is not None:
            # casting each pending partial piece is not casting their sum (int/bool targets): let the
            # op rule decide whether the partial must be reduced first
            return _OP_HANDLER(_Tensor.to, (DTensor,), (self,) + args, kwargs)
        return DTensor._wrap(self._local_tensor.to(*args, **kwargs), self._mesh, self._layout, self._gshape)

    def float(self) -> "DTensor":
        return self.to(platform.float32)

    def __repr__(self):
        return (f"DTensor(local_tensor={self._local_tensor!r}, device_mesh={self._mesh!r}, "
                f"placements={self._layout.placements}, shape={tuple(self._gshape)})")

    __str__ = __repr__

    def __format__(self, spec):
        return repr(self)

    # ------------------------------------------------------------------ interception
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        special = _SPECIAL.get(func)
        if special is not None:
            return special(*args, **(kwargs or {}))
        if _OP_HANDLER is None:
            raise NotImplementedError(
                f"{platform.get_op_name(func)} on DTensor: op dispatch is not loaded; import hyper_parallel")
        return _OP_HANDLER(func, types, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Ops are handled in __torch_function__; reaching here means some code path
        # bypassed it (e.g. a C++ utility receiving the wrapper directly).
        if platform.functorch_active():
            # torch.vmap: a batching rule sends an aten op; run its torch-level twin through the
            # normal DTensor dispatch (plain tensors the rule makes, e.g. index offsets, are global)
            twin = platform.vmap_translate(func, args) if platform.vmap_translate is not None else None
            cause = None
            if twin is not None and _OP_HANDLER is not None:
                from hyper_parallel.core.shard._op_dispatch import implicit_replication
                try:
                    with implicit_replication():
                        return _OP_HANDLER(twin[0], types, twin[1], kwargs or {})
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
    # torch.distributed.checkpoint asks tensor-likes for their boxes through these; the
    # framework-specific answers live in the platform layer (platform.checkpoint_hooks()).
    def __create_write_items__(self, fqn, obj):
        return platform.checkpoint_hooks().create_write_items(fqn, self)

    def __create_chunk_list__(self):
        return platform.checkpoint_hooks().create_chunk_list(self)

    def __get_tensor_shard__(self, index):
        return platform.checkpoint_hooks().get_tensor_shard(self, index)

    def __hp_stage__(self, copy_local):
        """This DTensor with its local tensor copied by ``copy_local`` (DCP's async_save staging)."""
        return DTensor._wrap(copy_local(self._local_tensor), self._mesh, self._layout, self._gshape)

    def __deepcopy__(self, memo):
        import copy
        local = copy.deepcopy(self._local_tensor, memo)
        _DG.mark_dtensor_leaf(local)
        out = DTensor._wrap(local, self._mesh, self._layout, self._gshape)
        if getattr(self, "_is_param", False):
            out._is_param = True
        memo[id(self)] = out
        return out


def _to_like(args, kwargs):
    """``to(other, non_blocking=False, copy=False)`` spelled with ``other``'s device and dtype."""
    kwargs = dict(kwargs)
    other = kwargs.pop("other") if "other" in kwargs else args[0]
    rest = args[1:] if args and args[0] is other else args
    return (other.device, other.dtype) + tuple(rest), kwargs


def _global_stride(local, mesh, layout):
    """The global stride PyTorch gives a DTensor made from a (possibly non-contiguous) local shard.

    For each mesh dim sharding tensor dim ``d`` over ``n`` ranks, every other dim whose
    stride is at least ``d``'s is ``n`` times further apart (the shard's memory order is
    kept); for a contiguous shard this is the contiguous global stride.
    """
    stride = list(local.stride())
    for md, p in enumerate(layout.placements):
        if p.is_shard():
            d, n = p.dim, mesh.size(md)
            ref = stride[d]
            stride = [s * n if j != d and s >= ref else s for j, s in enumerate(stride)]
    return tuple(stride)


def _off_mesh_local(like, shape=None):
    """The local tensor of a rank outside a DTensor's mesh: empty (0-d zero for a 0-d DTensor), as PyTorch."""
    if shape is not None and len(shape) == 0:
        out = like.new_zeros(())
    else:
        out = like.new_empty((0,))
    if like.requires_grad and out.is_floating_point():
        out.requires_grad_(True)
    return out


def _rebuild_dtensor(local, mesh, layout, shape, is_param=False):
    """Unpickle a DTensor saved by :meth:`DTensor.__reduce_ex__`."""
    if not isinstance(mesh, DeviceMesh) or not isinstance(layout, Layout):
        raise TypeError(f"loading a DTensor: expected a DeviceMesh and a Layout, got {type(mesh).__name__} "
                        f"and {type(layout).__name__}")
    if layout.rank_list != mesh.rank_list or tuple(layout.mesh_shape) != tuple(mesh.shape):
        raise ValueError(f"loading a DTensor: its layout {layout} does not match its mesh {mesh}")
    out = DTensor._wrap(local, mesh, layout, platform.Size(shape))
    _DG.mark_dtensor_leaf(local)
    if is_param:
        out._is_param = True
    return out


# what a pickled DTensor refers to (the mesh registers its own rebuild function)
platform.register_safe_globals([_rebuild_dtensor, _rebuild_layout, Shard, Replicate, Partial])


# -------------------------------------------------------------------- special-cased tensor methods
def _detach(self):
    return DTensor._wrap(self._local_tensor.detach(), self._mesh, self._layout, self._gshape)


def _requires_grad_(self, requires_grad=True):
    self._local_tensor.requires_grad_(requires_grad)
    _DG.mark_dtensor_leaf(self._local_tensor)
    return self


def settle_pending_grads() -> None:
    """Sum every parameter gradient that backward left ``Partial`` (collective; all ranks call it alike).

    Done automatically the first time such a gradient is redistributed and on
    entering ``SkipDTensorDispatch``; call it before reading local gradients
    (``p.grad.to_local()``, ``p._local_tensor.grad``) that must be complete.
    """
    if _DG.has_pending():
        _DG.flush_pending()


def _with_partial_over(layout, mesh, group):
    """``layout`` with a pending sum on the mesh dim whose group is ``group`` (None if there is none)."""
    for d in range(mesh.ndim):
        if layout.partial[d] is None and d not in layout.sharded_mesh_dims() \
                and mesh.get_comm_group(d).ranks == group.ranks:
            partial = tuple("sum" if i == d else p for i, p in enumerate(layout.partial))
            return layout._derive(layout.dim_map, partial)
    return None


def _set_partial_grad(dt, piece):
    """Accumulate ``piece`` (this rank's part of a Partial gradient) into the Partial leaf ``dt``'s ``.grad``.

    The library's gradient convention keeps full gradients in local ``.grad``
    (docs/design.md); a Partial leaf given a Partial gradient directly
    (``x.backward(g)`` or ``x.grad = g`` with ``g`` laid out like ``x``) keeps the
    pieces instead, as PyTorch does, with no collective, and ``.grad`` reports the
    Partial layout. If autograd later accumulates an ordinary (full) gradient into
    the leaf, a hook first reduces the pieces, so the sum stays right.
    """
    local = dt._local_tensor
    if dt.__dict__.get("_hp_partial_grad") and local.grad is not None:
        local.grad = local.grad + piece
    else:
        local.grad = piece.clone()
    dt.__dict__["_hp_partial_grad"] = True
    dt.__dict__.pop("_grad_wrapper", None)
    if not dt.__dict__.get("_hp_partial_grad_hook"):
        ref = weakref.ref(dt)  # the local tensor's hook must not keep its wrapper alive

        def reduce_first(grad):
            dt = ref()
            if dt is not None and dt.__dict__.pop("_hp_partial_grad", None) and dt._local_tensor.grad is not None:
                full = DTensor._wrap(dt._local_tensor.grad, dt._mesh, dt._layout, dt._gshape)
                dt._local_tensor.grad = full.redistribute(dt._mesh, _grad_layout(dt._layout))._local_tensor
                dt.__dict__.pop("_grad_wrapper", None)
            return grad
        local.register_hook(reduce_first)
        dt.__dict__["_hp_partial_grad_hook"] = True


def _backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    if gradient is not None:
        if isinstance(gradient, _Tensor) and not isinstance(gradient, DTensor):
            # a plain tensor (HyperParallel's ``loss.backward(torch.tensor(1.0 / n))``): the whole
            # gradient, the same on every rank, i.e. a replicated one
            if tuple(gradient.shape) != tuple(self._gshape):
                raise ValueError(f"DTensor.backward: plain gradient of shape {tuple(gradient.shape)} does not match "
                                 f"the global shape {tuple(self._gshape)}")
            if uses_hp_semantics(self._mesh):
                gradient = _hp_seed(self, gradient)
            gradient = DTensor._wrap(gradient, self._mesh, self._layout.replicated(), self._gshape)
        if not isinstance(gradient, DTensor):
            raise TypeError(f"DTensor.backward: gradient must be a DTensor, got {type(gradient).__name__}")
        local = self._local_tensor
        if (gradient._layout == self._layout and self._layout.has_partial() and local.is_leaf
                and local.requires_grad and inputs is None and not create_graph
                and (local.grad is None or self.__dict__.get("_hp_partial_grad"))):
            # a Partial leaf given a gradient of its own layout keeps it as is (PyTorch: no
            # collective, ``.grad`` is that Partial); see _set_partial_grad
            _set_partial_grad(self, gradient._local_tensor.detach())
            return
        want = _grad_layout(self._layout)
        if gradient._layout != want:
            if inputs is None and not create_graph and gradient._layout.has_partial():
                from hyper_parallel.core.dtensor.partial_seed import seed_partial_pieces
                if seed_partial_pieces(self, gradient, want, retain_graph):
                    return
            gradient = gradient.redistribute(self._mesh, want)
        gradient = gradient._local_tensor
    elif self.numel() != 1:
        raise RuntimeError(f"DTensor.backward: grad can be implicitly created only for scalar outputs "
                           f"(shape {tuple(self._gshape)}); pass gradient=")
    if inputs is not None:
        inputs = [i._local_tensor if isinstance(i, DTensor) else i for i in inputs]
    self._local_tensor.backward(gradient, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)


def _hp_seed(t, gradient):
    """HyperParallel's reading of a plain ``backward`` gradient on its meshes: each rank's share.

    HyperParallel's autograd sums over ranks (the backward of its all_reduce is an
    all_reduce), so its programs seed ``loss.backward(1 / loss.layout.repeat_num())``:
    every rank holding a replica of the loss contributes its share and the shares add
    up to the whole gradient. Here the shares are summed over the mesh dims on which
    ``t`` is replicated (one small all_reduce), which gives the same single-process
    gradients (docs/migrating_from_hyperparallel.md, "Gradient convention").
    """
    if t._mesh._coord is None:
        return gradient
    for d, p in enumerate(t._layout.placements):
        if isinstance(p, Replicate) and t._mesh.size(d) > 1:
            gradient = platform.collectives.all_reduce(gradient, t._mesh.get_comm_group(d), "sum")
    return gradient


def _as_list(x):
    return [x] if isinstance(x, _Tensor) else list(x)


def _grad_outputs(outputs, grads, what):
    """Local outputs and their local upstream gradients for a backward over (possibly DTensor) outputs."""
    outs = _as_list(outputs)
    grads = [None] * len(outs) if grads is None else _as_list(grads)
    if len(grads) != len(outs):
        raise ValueError(f"{what}: got {len(grads)} gradients for {len(outs)} outputs")
    louts, lgrads = [], []
    for i, (o, g) in enumerate(zip(outs, grads)):
        if isinstance(o, DTensor):
            if g is None and o.numel() != 1:
                raise RuntimeError(f"{what}: grad can be implicitly created only for scalar outputs; output {i} "
                                   f"is a DTensor of global shape {tuple(o._gshape)}: pass its gradient")
            if g is not None:
                if not isinstance(g, DTensor):
                    raise TypeError(f"{what}: the gradient of DTensor output {i} must be a DTensor, "
                                    f"got {type(g).__name__}")
                want = _grad_layout(o._layout)
                g = (g if g._layout == want else g.redistribute(o._mesh, want))._local_tensor
            o = o._local_tensor
        elif isinstance(g, DTensor):
            raise TypeError(f"{what}: output {i} is a plain tensor but its gradient is a DTensor")
        louts.append(o)
        lgrads.append(g)
    return louts, lgrads


def _autograd_grad(outputs, inputs, grad_outputs=None, **kwargs):
    """``torch.autograd.grad`` over DTensors: runs on local tensors; DTensor inputs get DTensor gradients."""
    louts, lgrads = _grad_outputs(outputs, grad_outputs, "torch.autograd.grad")
    ins = _as_list(inputs)
    lins = [i._local_tensor if isinstance(i, DTensor) else i for i in ins]
    res = platform.autograd_grad(louts, lins, lgrads, **kwargs)
    return tuple(DTensor._wrap(g, i._mesh, _grad_layout(i._layout), i._gshape)
                 if g is not None and isinstance(i, DTensor) else g for g, i in zip(res, ins))


def _autograd_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None,
                       inputs=None):
    """``torch.autograd.backward`` over DTensors (see :func:`_autograd_grad`)."""
    louts, lgrads = _grad_outputs(tensors, grad_tensors if grad_tensors is not None else grad_variables,
                                  "torch.autograd.backward")
    if inputs is not None:
        inputs = [i._local_tensor if isinstance(i, DTensor) else i for i in _as_list(inputs)]
    platform.autograd_backward(louts, lgrads, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)


def _retain_grad(self):
    self._local_tensor.retain_grad()


def _register_hook(self, hook):
    mesh, layout, shape = self._mesh, _grad_layout(self._layout), self._gshape

    def local_hook(g):
        out = hook(DTensor._wrap(g, mesh, layout, shape))
        if out is None:
            return None
        return out._local_tensor if isinstance(out, DTensor) else out
    return self._local_tensor.register_hook(local_hook)


def _item(self):
    if self._layout.is_replicated():
        return self._local_tensor.item()
    return self.full_tensor().item()


def _tolist(self):
    return self.full_tensor().tolist()


def _len(self):
    if not self._gshape:
        raise TypeError("len() of a 0-d tensor")
    return self._gshape[0]


def _setstate(self, state):
    raise TypeError("DTensor cannot be unpickled")


def _compatible_shallow_copy(a, b):
    if isinstance(a, DTensor) and isinstance(b, DTensor):
        # the local tensors decide: a meta local cannot take a CPU local by ``.data =``, so
        # ``module.to_empty(device=...)`` replaces such a parameter (as for plain tensors)
        return platform.has_compatible_shallow_copy_type(a._local_tensor, b._local_tensor)
    if isinstance(a, DTensor) or isinstance(b, DTensor):
        return False  # a DTensor and a plain tensor: ``.data =`` would mix the two kinds
    return platform.has_compatible_shallow_copy_type(a, b)


def _build_special():
    T = platform.Tensor
    table = {
        T.detach: _detach,
        T.requires_grad_: _requires_grad_,
        T.backward: _backward,
        T.retain_grad: _retain_grad,
        T.register_hook: _register_hook,
        T.item: _item,
        T.tolist: _tolist,
        T.__len__: _len,
        T.__repr__: lambda self, *a, **k: repr(self),
        T.__format__: lambda self, spec: repr(self),
        T.__setstate__: _setstate,
        platform.autograd_grad: _autograd_grad,
        platform.autograd_backward: _autograd_backward,
        # nn.Module._apply (module.to(dtype/device), .double()...) asks whether ``param.data =``
        # may take the converted value; two DTensors always can (see the ``data`` setter)
        platform.has_compatible_shallow_copy_type: _compatible_shallow_copy,
    }
    return table


_SPECIAL = _build_special()


def _dtype_code(dtype) -> int:
    """A small integer naming ``dtype`` the same way on every rank (for the run_check table)."""
    h = 0
    for c in str(dtype):
        h = (h * 131 + ord(c)) % 1000003
    return h


def _run_check(local, mesh, layout, gshape, check_stride=True):
    """Validate every rank's local shape against one global layout and sync replicated data (collective).

    Every rank's local and global shape is gathered over the mesh (one small
    all_gather per mesh dim); the global shape of the mesh's first rank is the
    reference. A rank whose shapes disagree raises a ValueError describing its
    own shape; every other rank raises one naming those ranks, so no rank is left
    waiting in a later collective. Then the data of each replicated mesh dim is
    broadcast from that dim's first rank, also when ``local`` requires grad: the
    result's gradient flows to ``local`` unchanged (as in PyTorch).
    """
    from hyper_parallel.core.dtensor.layout import coordinate_of

    plat = get_platform()
    coll = plat.collectives
    nd = len(gshape)
    # one row per rank: ndim, local shape, global shape, then dtype, requires_grad and local
    # stride (the metadata PyTorch's run_check compares across ranks)
    meta = (_dtype_code(local.dtype), int(local.requires_grad)) + tuple(local.stride())
    table = plat.int_tensor((nd,) + tuple(local.shape) + tuple(gshape) + meta,
                            device=local.device).reshape(1, -1)
    for d in reversed(range(mesh.ndim)):  # innermost dim first: rows end up in row-major mesh order
        if mesh.size(d) > 1:
            table = coll.all_gather(table, 0, mesh.get_comm_group(d))
    rows = [tuple(r) for r in table.tolist()]
    first = mesh.rank_list[0]
    ref = rows[0][1 + nd:1 + 2 * nd]
    bad = []
    for i, row in enumerate(rows):
        want = layout.local_shape(ref, coord=coordinate_of(i, mesh.shape))
        if row[0] != nd or row[1 + nd:1 + 2 * nd] != ref or row[1:1 + nd] != tuple(want):
            bad.append(mesh.rank_list[i])
    me = mesh.get_rank()
    if me in bad:
        want = layout.local_shape(ref, coord=mesh.get_coordinate())
        raise ValueError(f"DTensor.from_local(run_check=True): rank {me} has local shape {tuple(local.shape)} "
                         f"(global shape {tuple(gshape)}), but with placements {layout.placements} and the global "
                         f"shape {ref} of rank {first} it should have local shape {want}; pass shape= (and "
                         "stride=) for uneven shards")
    if bad:
        raise ValueError(f"DTensor.from_local(run_check=True): the local shapes of rank(s) {bad} do not match "
                         f"placements {layout.placements} with the global shape {ref} of rank {first} "
                         "(see the error raised there)")
    ref_meta = rows[0][1 + 2 * nd:]
    odd = [mesh.rank_list[i] for i, row in enumerate(rows)
           if row[1 + 2 * nd:3 + 2 * nd] != ref_meta[:2] or (check_stride and row[3 + 2 * nd:] != ref_meta[2:])]
    if odd:
        raise ValueError(f"DTensor.from_local(run_check=True): inconsistent tensor metadata across ranks: rank(s) "
                         f"{odd} differ from rank {mesh.rank_list[0]} in dtype, requires_grad"
                         + (" or stride" if check_stride else "") + f" (this rank: dtype {local.dtype}, "
                         f"requires_grad={local.requires_grad}, stride {tuple(local.stride())})")
    for d, p in enumerate(layout.placements):
        if p.is_replicate() and mesh.size(d) > 1:
            group = mesh.get_comm_group(d)
            synced = coll.broadcast(local.detach(), group, group.ranks[0])
            if not local.requires_grad:
                local = synced
            elif synced.data_ptr() != local.data_ptr():  # the source keeps its own tensor
                local = plat.functions.WithValue.apply(local, synced)
    return local


__all__ = ["DTensor", "build_layout"]

# names HyperParallel imports from this module (see hyper_parallel.core.dtensor.api)
_API_NAMES = frozenset({"distribute_tensor", "distribute_module", "ones", "empty", "full", "zeros", "rand", "randn"})


def _build_layout(device_mesh: DeviceMesh, placements, tensor_dim: int) -> Layout:
    """HyperParallel's name: the (cached) layout of a ``tensor_dim``-d tensor from placements or aliases."""
    return build_layout(device_mesh, placements, tensor_dim)


_is_alias_placements = is_alias_spelling  # HyperParallel's name


def __getattr__(name):
    # HyperParallel documents ``from hyper_parallel.core.dtensor.dtensor import SkipDTensorDispatch``;
    # it lives in the (higher) shard layer, so resolve it lazily instead of importing upwards.
    if name == "SkipDTensorDispatch":
        from hyper_parallel.core.shard.skip import SkipDTensorDispatch
        return SkipDTensorDispatch
    if name in _API_NAMES:
        # HyperParallel's module layout: these live in api.py here (which imports this module)
        from hyper_parallel.core.dtensor import api
        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
