"""The framework-neutral platform interface.

Everything the core needs from a deep-learning framework is reached through one
``Platform`` object (see :func:`hyper_parallel.platform.get_platform`). The core
never imports a framework itself, so a second framework (MindSpore) can be added
by writing another subclass.
"""
from __future__ import annotations

import enum


class PlatformType(enum.Enum):
    PYTORCH = "torch"
    MINDSPORE = "mindspore"


class CommGroup:
    """A communication group: the global ranks in it and the framework handle.

    ``ranks`` is ordered by in-group rank; ``rank`` is this process's index in it
    (or -1 when the process is not a member).
    """

    __slots__ = ("ranks", "handle", "rank", "size", "dims")

    def __init__(self, ranks, handle, my_global_rank):
        self.ranks = tuple(ranks)
        self.handle = handle
        self.size = len(self.ranks)
        self.rank = self.ranks.index(my_global_rank) if my_global_rank in self.ranks else -1
        self.dims = ()  # "mesh dim 'tp' of mesh (2, 2)"...: named in collective errors (see name_dim)

    def name_dim(self, description: str) -> None:
        """Record that this group serves a mesh dim (``description``), for the messages of failed collectives.

        Meshes share groups over the same ranks: the three most recent descriptions are kept, newest first.
        """
        self.dims = ((description,) + tuple(d for d in self.dims if d != description))[:3]

    def __repr__(self):
        return f"CommGroup(ranks={self.ranks})"


class Platform:
    """Abstract platform. Subclasses fill in types, tensor helpers and collectives."""

    platform_type: PlatformType = None

    # Types (set by subclasses)
    Tensor = None
    Module = None
    Parameter = None
    tree_flatten = None    # pytree (torch.utils._pytree): local_map flattens inputs and outputs
    tree_unflatten = None
    Function = None
    DTensorBase = None
    autograd_grad = None      # torch.autograd.grad's contract
    autograd_backward = None  # torch.autograd.backward's contract
    has_compatible_shallow_copy_type = None  # may ``a.data = b``? (asked by Module.to)
    strided = None            # the dense tensor layout (for wrapper construction)
    framework_package = ""    # the framework's top-level package name (its code reads Tensor.layout)
    set_wrapper_data = None   # (wrapper, other): give a wrapper subclass other's dtype/device/sizes
    register_safe_globals = None  # (objs): rebuild functions/classes allowed by a safe (weights-only) load
    bump_version = None       # (t): mark t modified in place (kernels that do not say so themselves)
    vmap_translate = None     # (op, args): the framework-level (function, args) of a low-level op under vmap

    @staticmethod
    def framework_current_mesh():
        """The framework's own current device mesh (``with mesh:``), or None."""
        return None

    @staticmethod
    def describe_foreign_mesh(obj):
        """The framework's own device-mesh object described as (device_type, nested ranks, names, {dim: group}); None if ``obj`` is not one."""
        return None

    # The per-op fast path (hyper_parallel.core.shard._fast_methods) needs: whether
    # torch-function dispatch is enabled / a torch-function mode is active (cheap
    # checks), and torch_function_func(method_name), the function object that
    # __torch_function__ receives for a Tensor method (it keys the dispatch cache).
    torch_function_enabled = None
    torch_function_mode_enabled = None
    torch_function_func = None

    # Namespaces (set by subclasses): ``collectives`` (plain collectives on local
    # tensors), ``functions`` (differentiable collectives, one autograd function
    # each) and ``deferred_grads`` (gradient reductions batched at the end of
    # backward: ``DeferredPartialGrad``, ``defer_average``).
    collectives = None
    functions = None
    deferred_grads = None
    compile_support = None  # torch.compile support (traced ops, functional collectives), if any
    fault = None  # failed collectives: error wrapping, the timeout on groups, the desync check (faults.py)

    @staticmethod
    def default_device_type() -> str:
        """The device type of a mesh created without one (e.g. ``fully_shard``'s default mesh)."""
        return "cpu"

    @staticmethod
    def register_dtensor_class(cls) -> None:
        """Tell the platform which class is the core's DTensor (for framework hooks that must recognise it)."""
        return None

    # ------------------------------------------------------------ feature registry
    # Feature mechanics that need the core (e.g. ``fully_shard``'s, which builds DTensors)
    # live in feature packages of the platform. The platform's root never imports them
    # (it sits below the core); the composition root (``hyper_parallel/__init__.py``)
    # imports every package named here, and each registers its mechanics with
    # :meth:`register_feature`. The core then reaches them by :meth:`feature`.
    feature_packages: tuple = ()
    # Feature packages that may fail to import on a framework version other than the pinned one (they
    # use its newer or private APIs); the others must import. A failure is kept and reported by
    # :meth:`feature` when that feature is asked for.
    optional_feature_prefixes: tuple = ()

    def note_feature_unavailable(self, package: str, exc: BaseException) -> None:
        """Record that feature package ``package`` could not be imported (the reason is shown by :meth:`feature`)."""
        errs = type(self).__dict__.get("_feature_errors")
        if errs is None:
            errs = {}
            setattr(type(self), "_feature_errors", errs)
        errs[package] = f"{type(exc).__name__}: {exc}"

    def register_feature(self, name: str, obj) -> None:
        """Make ``obj`` (a module or object holding a feature's mechanics) what ``feature(name)`` returns."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"register_feature: name must be a non-empty str, got {name!r}")
        feats = type(self).__dict__.get("_features")
        if feats is None:
            feats = {}
            setattr(type(self), "_features", feats)
        feats[name] = obj

    def feature(self, name: str):
        """The mechanics registered under ``name``; a clear error if no feature package registered it."""
        obj = (type(self).__dict__.get("_features") or {}).get(name)
        if obj is None:
            raise RuntimeError(
                f"hyper_parallel: platform feature {name!r} is not registered on the "
                f"{type(self).__name__}; it is registered when its feature package is imported "
                f"(one of {list(self.feature_packages)}), which 'import hyper_parallel' does"
                + "".join(f"; {pkg} could not be imported on this installation ({why})"
                          for pkg, why in (type(self).__dict__.get("_feature_errors") or {}).items()))
        return obj
