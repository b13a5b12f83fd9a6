"""``hyper_parallel.platform.get_platform()``: a compatibility facade for HyperParallel programs that call it.

The library has no platform indirection: its code imports torch where it needs torch, and the
ground floor (``hyper_parallel.distributed``) adapts torch.distributed. HyperParallel removed its
own platform layer in 2026-09; this facade keeps the old call working (``hyper_parallel/compat/platform.py``
says what it answers). ``HYPER_PARALLEL_PLATFORM`` may still name ``torch``; anything else is refused.
"""
from __future__ import annotations

import os

from hyper_parallel.compat.platform import CommGroup, Platform, PlatformType, TorchPlatform

_PLATFORM = None
_ENV = "HYPER_PARALLEL_PLATFORM"


def _detect() -> str:
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


__all__ = ["get_platform", "Platform", "PlatformType", "CommGroup"]
