"""``get_platform()``: HyperParallel's platform object, kept for programs that call it (a facade).

The public path is ``hyper_parallel.platform`` (``hyper_parallel/platform/__init__.py`` re-exports this).

HyperParallel removed its platform layer and its MindSpore backend in 2026-09 (its PR #846) and
calls torch directly; so does this library. Programs written against the old API still call
``hyper_parallel.platform.get_platform()`` and read the names below from it: each is the torch
object or the ground-floor function that the library itself calls (``hyper_parallel.distributed``,
``hyper_parallel.dtensor.torch_internals``). Nothing in the library reads this object.
"""
from __future__ import annotations

import enum
import os

import torch
import torch.nn as _nn
import torch.nn.functional as _F

from hyper_parallel.compile import compile_mode as _compile_mode
from hyper_parallel.distributed import collective_guard as _guard
from hyper_parallel.distributed import collectives as _collectives
from hyper_parallel.distributed import deferred_grads as _deferred_grads
from hyper_parallel.distributed import differentiable as _differentiable
from hyper_parallel.distributed import groups as _groups
from hyper_parallel.distributed import rng as _rng
from hyper_parallel.distributed.comm_group import CommGroup
from hyper_parallel.dtensor import torch_internals as _ti


class PlatformType(enum.Enum):
    PYTORCH = "torch"
    MINDSPORE = "mindspore"


class Platform:
    """HyperParallel's platform base class (kept so ``isinstance(get_platform(), Platform)`` holds)."""

    platform_type: PlatformType = None


class TorchPlatform(Platform):
    """The torch platform: every attribute is torch's own object or the library's ground-floor function."""

    platform_type = PlatformType.PYTORCH
    # types and namespaces
    Tensor = torch.Tensor
    DTensorBase = torch.Tensor
    Module = _nn.Module
    Parameter = _nn.Parameter
    Function = torch.autograd.Function
    Size = torch.Size
    float32 = torch.float32
    strided = torch.strided
    framework_package = "torch"
    ops = torch
    F = _F
    nn = _nn
    autograd_grad = staticmethod(torch.autograd.grad)
    autograd_backward = staticmethod(torch.autograd.backward)
    collectives = _collectives
    functions = _differentiable
    deferred_grads = _deferred_grads
    compile_support = _compile_mode
    fault = _guard
    # process groups (hyper_parallel.distributed.groups)
    is_initialized = staticmethod(_groups.is_initialized)
    init_process_group = staticmethod(_groups.init_process_group)
    get_rank = staticmethod(_groups.get_rank)
    get_world_size = staticmethod(_groups.get_world_size)
    new_group = staticmethod(_groups.new_group)
    has_group = staticmethod(_groups.has_group)
    reset_groups = staticmethod(_groups.reset_groups)
    release_groups = staticmethod(_groups.release_groups)
    describe_foreign_mesh = staticmethod(_groups.describe_foreign_mesh)
    framework_current_mesh = staticmethod(_groups.framework_current_mesh)
    default_device_type = staticmethod(_groups.default_device_type)
    default_device = staticmethod(_groups.default_device)
    # tensors and random numbers
    chunk = staticmethod(torch.chunk)
    cat = staticmethod(torch.cat)
    empty = staticmethod(torch.empty)
    zeros = staticmethod(torch.zeros)
    ones = staticmethod(torch.ones)
    full = staticmethod(torch.full)
    is_tensor = staticmethod(torch.is_tensor)
    grad_enabled = staticmethod(torch.is_grad_enabled)
    initial_seed = staticmethod(torch.initial_seed)
    seeded_random = staticmethod(_rng.seeded_random)
    narrow_block = staticmethod(_rng.narrow_block)
    element_size = staticmethod(_ti.element_size)
    meta_empty = staticmethod(_ti.meta_empty)
    op_name = staticmethod(_ti.op_name)
    get_op_name = staticmethod(_ti.op_name)
    bump_version = staticmethod(_ti.bump_version)
    set_wrapper_data = staticmethod(_ti.set_wrapper_data)
    torch_function_func = staticmethod(_ti.torch_function_func)
    torch_function_enabled = staticmethod(_ti.torch_function_enabled)
    torch_function_mode_enabled = staticmethod(_ti.torch_function_mode_enabled)
    functorch_active = staticmethod(_ti.functorch_active)
    allow_foreach = staticmethod(_ti.allow_foreach)


_PLATFORM = None
_ENV = "HYPER_PARALLEL_PLATFORM"


def _detect() -> str:
    """``HYPER_PARALLEL_PLATFORM`` may still name ``torch``; anything else is refused."""
    requested = os.environ.get(_ENV, "").strip().lower()
    if requested and requested != "torch":
        if requested == "mindspore":
            raise ValueError(f"{_ENV}={requested!r} is not supported: hyper_parallel runs on torch only "
                             "(HyperParallel removed its MindSpore backend in 2026-09); expected 'torch'")
        raise ValueError(f"{_ENV}={requested!r} is not supported; expected 'torch'")
    return "torch"


def get_platform() -> Platform:
    """The process-wide platform object (a facade over torch and ``hyper_parallel.distributed``)."""
    global _PLATFORM
    if _PLATFORM is None:
        _detect()
        _PLATFORM = TorchPlatform()
    return _PLATFORM


__all__ = ["CommGroup", "Platform", "PlatformType", "TorchPlatform", "get_platform"]
