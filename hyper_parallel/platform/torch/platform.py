"""PyTorch implementation of :class:`hyper_parallel.platform.Platform`."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from hyper_parallel.platform.platform import CommGroup, Platform, PlatformType
from hyper_parallel.platform.torch import collectives, deferred_grads, fault, functions
from hyper_parallel.platform.torch.checkpoint import staging as checkpoint_staging
from hyper_parallel.platform.torch.compile import support as compile_support
from hyper_parallel.platform.torch import testing_hook as _testing_hook  # noqa: F401  (torch.testing DTensor rule)

checkpoint_staging.install()  # async_save's stager learns to copy DTensors (see checkpoint/staging.py)



def _launch_mod():
    from hyper_parallel.platform.torch import launch  # process-group start and exit (restarts, teardown)
    return launch


class TorchPlatform(Platform):
    platform_type = PlatformType.PYTORCH

    Tensor = torch.Tensor
    Module = nn.Module
    Parameter = nn.Parameter
    tree_flatten = staticmethod(torch.utils._pytree.tree_flatten)
    tree_unflatten = staticmethod(torch.utils._pytree.tree_unflatten)
    Function = torch.autograd.Function
    autograd_grad = staticmethod(torch.autograd.grad)
    autograd_backward = staticmethod(torch.autograd.backward)
    has_compatible_shallow_copy_type = staticmethod(torch._has_compatible_shallow_copy_type)
    DTensorBase = torch.Tensor
    Size = torch.Size

    float32 = torch.float32
    strided = torch.strided
    framework_package = "torch"  # whose own code reads Tensor.layout as a memory layout

    @staticmethod
    def functorch_active() -> bool:
        """Whether a functorch transform (``torch.vmap``, ``torch.func.grad``...) is running.

        Inside a batching rule the transform's level is already popped, but its dispatch
        keys are still excluded in thread-local state: check both.
        """
        keys = torch._C.DispatchKey
        return (torch._C._functorch.maybe_current_level() is not None
                or torch._C._dispatch_tls_is_dispatch_key_excluded(keys.FuncTorchBatched)
                or torch._C._dispatch_tls_is_dispatch_key_excluded(keys.FuncTorchDynamicLayerBackMode))

    @staticmethod
    def vmap_translate(aten_op, args):
        """``(torch_function, args)`` for an aten op that a vmap batching rule sends to a DTensor, or None."""
        from hyper_parallel.platform.torch.vmap_bridge import translate
        return translate(aten_op, args)

    @staticmethod
    def piece_graph():
        """The autograd-graph walk behind Partial-gradient seeds (see piece_graph.py)."""
        from hyper_parallel.platform.torch import piece_graph
        return piece_graph

    @staticmethod
    def function_hook():
        """The module that routes ``autograd.Function.apply`` on DTensors (see function_hook.py)."""
        from hyper_parallel.platform.torch import function_hook
        return function_hook

    @staticmethod
    def comm_keys() -> dict:
        """torch's key objects for collectives -> hyper_parallel collective kind (see comm_keys.py)."""
        from hyper_parallel.platform.torch.comm_keys import torch_comm_keys
        return torch_comm_keys()

    @staticmethod
    def module_tracker():
        """A tracker of the running modules for per-module collective counts (see comm_keys.py)."""
        from hyper_parallel.platform.torch.comm_keys import module_tracker
        return module_tracker()

    @staticmethod
    def torch_function_func(method_name: str):
        """The function ``__torch_function__`` receives when Tensor method ``method_name`` is called.

        (``a + b`` arrives as ``Tensor.add``.) Found by calling the method on a probe
        subclass with a few argument patterns; None if none of them reaches it.
        """
        class _Seen(Exception):
            pass

        class _Probe(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                raise _Seen(func)

        probe = torch.zeros(2, 2).as_subclass(_Probe)
        for args in ((), (torch.ones(2, 2),), (0,), (0, 1), (-1,)):
            try:
                getattr(probe, method_name)(*args)
            except _Seen as seen:
                return seen.args[0]
            except Exception:  # noqa: BLE001 - wrong argument pattern: try the next one
                continue
        return None

    @staticmethod
    def set_wrapper_data(wrapper, other):
        """Give tensor subclass ``wrapper`` the C-level metadata (dtype, device, sizes) of ``other``.

        The subclass's Python attributes are the caller's to update; this is the
        part Python cannot reach (``Tensor.data``'s C setter, below torch functions).
        """
        with torch._C.DisableTorchFunctionSubclass():
            torch._C.TensorBase.data.__set__(wrapper, other)

    @staticmethod
    def bump_version(t) -> None:
        """Mark tensor ``t`` as modified in place (for kernels that do not, e.g. the fused optimizers)."""
        if isinstance(t, torch.Tensor) and not t.is_inference():
            torch.autograd.graph.increment_version(t)

    # torch-function state (C functions: cheap enough for per-op checks)
    torch_function_enabled = staticmethod(torch._C._is_torch_function_enabled)
    torch_function_mode_enabled = staticmethod(torch._C._is_torch_function_mode_enabled)

    # namespaces
    collectives = collectives
    functions = functions
    deferred_grads = deferred_grads
    fault = fault  # failed collectives: errors naming the collective, the timeout, the desync check
    compile_support = compile_support  # torch.compile: DTensor ops as opaque nodes

    # feature packages (they import the core; the composition root imports them, see Platform)
    feature_packages = ("hyper_parallel.platform.torch.fully_shard", "hyper_parallel.platform.torch.pipelining",
                        "hyper_parallel.platform.torch.moe",
                        "hyper_parallel.platform.torch.context_parallel")
    # pipelining builds on torch.distributed.pipelining's private stage metadata (pinned torch 2.13);
    # on an older torch (e.g. a GPU machine's own install) the rest of the library still imports
    optional_feature_prefixes = ("hyper_parallel.platform.torch.pipelining",)

    @staticmethod
    def default_device_type() -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    @staticmethod
    def register_dtensor_class(cls) -> None:
        """``cls`` is the core's DTensor: ``torch.testing`` applies PyTorch's DTensor rule to it (testing_hook.py)."""
        _testing_hook.register_dtensor_class(cls)

    @staticmethod
    def checkpoint_hooks():
        """The ``torch.distributed.checkpoint`` hook implementations for DTensor (imported on first use)."""
        from hyper_parallel.platform.torch.checkpoint import dcp
        return dcp

    @staticmethod
    def checkpoint_state_dict():
        """The state-dict helpers behind ``hyper_parallel.checkpoint`` (imported on first use)."""
        from hyper_parallel.platform.torch.checkpoint import state_dict
        return state_dict

    def __init__(self):
        self._groups = {}

    # ------------------------------------------------------------ process groups
    def is_initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def init_process_group(self, device_type: str = "cpu", timeout_s: float = None) -> None:
        """Initialise the default group from torchrun-style env vars if needed."""
        if self.is_initialized():
            return
        backend = "nccl" if device_type == "cuda" else "gloo"
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"torch.distributed is not initialised and the environment lacks {missing}; "
                "launch with torchrun or call torch.distributed.init_process_group first")
        # restart-safe under torchrun's shared agent store, and groups destroyed at exit (launch.py);
        # the one collective timeout (faults.collective_timeout: HYPER_PARALLEL_COLLECTIVE_TIMEOUT, setter)
        _launch_mod().init_default_group(backend, timedelta(seconds=timeout_s) if timeout_s else fault.group_timeout(),
                                         release=self.release_groups)
        fault.adopt(dist.group.WORLD, created=True)
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    def get_rank(self) -> int:
        return dist.get_rank() if self.is_initialized() else 0

    def get_world_size(self) -> int:
        return dist.get_world_size() if self.is_initialized() else 1

    def new_group(self, ranks) -> CommGroup:
        """Return the (cached) group over ``ranks``.

        ``torch.distributed.new_group`` is collective over the whole world, so every
        process must request the same groups in the same order; the mesh does so.
        """
        ranks = tuple(int(r) for r in ranks)
        grp = self._groups.get(ranks)
        if grp is None:
            if ranks == tuple(range(self.get_world_size())):
                handle = dist.group.WORLD
                fault.adopt(handle, created=False)
            else:
                handle = dist.new_group(list(ranks), use_local_synchronization=False, timeout=fault.group_timeout())
                fault.adopt(handle, created=True)
            grp = CommGroup(ranks, handle, self.get_rank())
            self._groups[ranks] = grp
            _launch_mod().install_exit_hook(self.release_groups)  # once per process (launch.py)
        return grp

    @staticmethod
    def framework_current_mesh():
        """The mesh of the innermost ``with torch_mesh:`` block, or None (torch keeps the stack privately)."""
        try:
            from torch.distributed.device_mesh import _mesh_resources
            stack = _mesh_resources.mesh_stack
        except (ImportError, AttributeError):  # pragma: no cover - another torch layout
            return None
        return stack[-1] if stack else None

    def describe_foreign_mesh(self, obj):
        """``(device_type, nested ranks, dim names, {dim: CommGroup})`` for a ``torch.distributed`` DeviceMesh, else None.

        A PyTorch user keeps ``torch.distributed.device_mesh.init_device_mesh`` when swapping
        the DTensor imports; that mesh already owns one process group per dim, so they
        are reused (registered in the group cache) instead of created again, which would
        be a collective that only the ranks meeting this mesh first might reach.
        """
        try:
            from torch.distributed.device_mesh import DeviceMesh as TorchMesh
        except ImportError:  # pragma: no cover - torch without distributed
            return None
        if not isinstance(obj, TorchMesh):
            return None
        ranks = obj.mesh.tolist()
        names = tuple(obj.mesh_dim_names) if obj.mesh_dim_names else None
        groups = {}
        if obj.get_coordinate() is not None and self.is_initialized():
            me = self.get_rank()
            coord = obj.get_coordinate()
            for d in range(obj.mesh.ndim):
                index = [slice(None) if i == d else c for i, c in enumerate(coord)]
                line = tuple(int(r) for r in obj.mesh[tuple(index)].tolist())
                grp = self._groups.get(line)
                if grp is None:
                    grp = CommGroup(line, obj.get_group(d), me)
                    self._groups[line] = grp
                    fault.adopt(grp.handle, created=False)
                grp.name_dim(f"mesh dim {d}{' ' + repr(names[d]) if names else ''} of torch mesh {tuple(obj.mesh.shape)}")
                groups[d] = grp
        return obj.device_type, ranks, names, groups

    def has_group(self, ranks) -> bool:
        """Whether the group over ``ranks`` was already created (creating one is collective)."""
        ranks = tuple(int(r) for r in ranks)
        return ranks in self._groups or (self.is_initialized() and ranks == tuple(range(self.get_world_size())))

    @staticmethod
    def register_safe_globals(objs) -> None:
        """Allow ``objs`` (rebuild functions, classes) in ``torch.load(weights_only=True)``."""
        torch.serialization.add_safe_globals(list(objs))

    def reset_groups(self) -> None:
        self._groups.clear()
        fault.forget_groups()

    def release_groups(self) -> None:
        """Drop this platform's references to process groups (at exit: launch.destroy_at_exit).

        The group cache, and through it every mesh, holds the ProcessGroup objects; while it does,
        ``dist.destroy_process_group()`` cannot free them and their gloo threads outlive it."""
        for grp in self._groups.values():
            grp.handle = None
        self._groups.clear()
        fault.forget_groups()  # the timeout registry holds the same groups

    # ------------------------------------------------------------ tensor helpers
    @staticmethod
    def chunk(x, chunks, dim=0):
        return torch.chunk(x, chunks, dim)

    @staticmethod
    def cat(xs, dim=0):
        return torch.cat(xs, dim)

    @staticmethod
    def empty(shape, **kw):
        return torch.empty(shape, **kw)

    @staticmethod
    def zeros(shape, **kw):
        return torch.zeros(shape, **kw)

    @staticmethod
    def ones(shape, **kw):
        return torch.ones(shape, **kw)

    @staticmethod
    def full(shape, fill_value, **kw):
        return torch.full(shape, fill_value, **kw)

    @staticmethod
    def is_tensor(x) -> bool:
        return isinstance(x, torch.Tensor)

    @staticmethod
    def element_size(dtype) -> int:
        return torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def get_op_name(op) -> str:
        name = getattr(op, "__name__", None) or getattr(op, "name", None) or repr(op)
        return name

    @staticmethod
    def default_device(device_type: str):
        if device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(device_type)

    @staticmethod
    def int_tensor(values, device=None):
        """1-d int64 tensor of ``values`` (metadata exchanged through collectives)."""
        return torch.tensor([int(v) for v in values], dtype=torch.long, device=device)

    @staticmethod
    def rank_tensor(ranks, shape):
        return torch.tensor(list(ranks), dtype=torch.long).reshape(tuple(shape))

    # ------------------------------------------------------------ seeded random
    @staticmethod
    def seeded_random(kind: str, shape, seed: int, dtype=None, device=None):
        """Random tensor of ``shape`` from a fresh generator seeded with ``seed`` (CPU generator, then moved)."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        dtype = dtype or torch.get_default_dtype()
        if kind == "rand":
            out = torch.rand(shape, generator=gen, dtype=dtype)
        elif kind == "randn":
            out = torch.randn(shape, generator=gen, dtype=dtype)
        else:
            raise ValueError(f"seeded_random: kind must be 'rand' or 'randn', got {kind!r}")
        return out if device is None or torch.device(device).type == "cpu" else out.to(device)

    @staticmethod
    def initial_seed() -> int:
        return torch.initial_seed()

    @staticmethod
    def narrow_block(x, offsets, sizes):
        for d, (o, s) in enumerate(zip(offsets, sizes)):
            if o != 0 or s != x.shape[d]:
                x = x.narrow(d, o, s)
        return x.contiguous()

    # ------------------------------------------------------------ dispatch support
    @staticmethod
    def outside_dispatch_modes():
        """Shape inference on meta tensors hidden from user TorchDispatchModes (SAC's op log), in eager mode;
        while compiling the modes stay (the fake-tensor mode is one of them)."""
        import contextlib

        from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack
        if torch.compiler.is_compiling():
            return contextlib.nullcontext()
        stack = _get_current_dispatch_mode_stack()
        # only user modes that log or replay ops (SAC, debug modes) are left out; tracing / fake-tensor
        # modes (their own subclasses' names) must see every op
        if not stack or any(any(k in type(m).__name__ for k in ("Fake", "Proxy", "Functional", "Tracing"))
                            for m in stack):
            return contextlib.nullcontext()
        return _disable_current_modes()

    @staticmethod
    def meta_empty(shape, dtype):
        return torch.empty(tuple(shape), dtype=dtype, device="meta")

    @staticmethod
    def to_meta(x):
        return x.to("meta")

    @staticmethod
    def hashable_leaf_types():
        return (torch.dtype, torch.device, torch.memory_format, torch.layout)

    @staticmethod
    def op_name(func) -> str:
        """Canonical name of a torch function / Tensor method / property getter."""
        name = getattr(func, "__name__", None)
        if name == "__get__":
            owner = getattr(func, "__self__", None)
            name = getattr(owner, "__name__", name)
        if name is None:
            name = getattr(func, "name", None) or repr(func)
        return name

    # Framework namespaces used by sharding rules to build local implementations.
    import torch as ops  # noqa: E402  (torch.* functions: sum, where, ...)
    import torch.nn.functional as F  # noqa: E402
    import torch.nn as nn  # noqa: E402

    @staticmethod
    def allow_foreach(tensor_type) -> None:
        """Let optimizers pick their foreach implementation for ``tensor_type`` (as torch does for its DTensor)."""
        try:
            from torch.utils import _foreach_utils
            if tensor_type not in _foreach_utils._foreach_supported_types:
                _foreach_utils._foreach_supported_types.append(tensor_type)
        except (ImportError, AttributeError):  # older/newer torch: the for-loop path still works
            pass

    @staticmethod
    def grad_enabled() -> bool:
        return torch.is_grad_enabled()
