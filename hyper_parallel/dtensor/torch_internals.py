"""The few torch internals the DTensor wrapper and its dispatcher rely on, each named once.

Why a module of its own: these reach below torch's public API (C-level tensor metadata,
torch-function state, functorch's dispatch keys, the foreach allow-list), and torch moves such
things between versions. Keeping them here means one file to fix on a torch upgrade.
"""
from __future__ import annotations

import torch


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


# torch-function state (C functions: cheap enough for per-op checks)
torch_function_enabled = torch._C._is_torch_function_enabled
torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled


def functorch_active() -> bool:
    """Whether a functorch transform (``torch.vmap``, ``torch.func.grad``...) is running.

    Inside a batching rule the transform's level is already popped, but its dispatch
    keys are still excluded in thread-local state: check both.
    """
    keys = torch._C.DispatchKey
    return (torch._C._functorch.maybe_current_level() is not None
            or torch._C._dispatch_tls_is_dispatch_key_excluded(keys.FuncTorchBatched)
            or torch._C._dispatch_tls_is_dispatch_key_excluded(keys.FuncTorchDynamicLayerBackMode))


def set_wrapper_data(wrapper, other):
    """Give tensor subclass ``wrapper`` the C-level metadata (dtype, device, sizes) of ``other``.

    The subclass's Python attributes are the caller's to update; this is the
    part Python cannot reach (``Tensor.data``'s C setter, below torch functions).
    """
    with torch._C.DisableTorchFunctionSubclass():
        torch._C.TensorBase.data.__set__(wrapper, other)


def bump_version(tensor) -> None:
    """Mark tensor ``tensor`` as modified in place (for kernels that do not, e.g. the fused optimizers)."""
    if isinstance(tensor, torch.Tensor) and not tensor.is_inference():
        torch.autograd.graph.increment_version(tensor)


def allow_foreach(tensor_type) -> None:
    """Let optimizers pick their foreach implementation for ``tensor_type`` (as torch does for its DTensor)."""
    try:
        from torch.utils import _foreach_utils
        if tensor_type not in _foreach_utils._foreach_supported_types:
            _foreach_utils._foreach_supported_types.append(tensor_type)
    except (ImportError, AttributeError):  # older/newer torch: the for-loop path still works
        pass


def op_name(func) -> str:
    """Canonical name of a torch function / Tensor method / property getter."""
    name = getattr(func, "__name__", None)
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", name)
    if name is None:
        name = getattr(func, "name", None) or repr(func)
    return name


def element_size(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def meta_empty(shape, dtype):
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


HASHABLE_LEAF_TYPES = (torch.dtype, torch.device, torch.memory_format, torch.layout)


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
