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

    __slots__ = ("ranks", "handle", "rank", "size")

    def __init__(self, ranks, handle, my_global_rank):
        self.ranks = tuple(ranks)
        self.handle = handle
        self.size = len(self.ranks)
        self.rank = self.ranks.index(my_global_rank) if my_global_rank in self.ranks else -1

    def __repr__(self):
        return f"CommGroup(ranks={self.ranks})"


class Platform:
    """Abstract platform. Subclasses fill in types, tensor helpers and collectives."""

    platform_type: PlatformType = None

    # Types (set by subclasses)
    Tensor = None
    Module = None
    Parameter = None
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
