"""Platform selection: the only place that decides which framework backs the core.

``HYPER_PARALLEL_PLATFORM=torch|mindspore`` picks one explicitly; otherwise the
first installed framework wins, PyTorch first.
"""
from __future__ import annotations

import importlib.util
import os

from hyper_parallel.platform.platform import CommGroup, Platform, PlatformType

_PLATFORM = None
_ENV = "HYPER_PARALLEL_PLATFORM"


def _detect() -> str:
    requested = os.environ.get(_ENV, "").strip().lower()
    if requested:
        if requested not in ("torch", "mindspore"):
            raise ValueError(f"{_ENV}={requested!r} is not supported; expected 'torch' or 'mindspore'")
        return requested
    if importlib.util.find_spec("torch") is not None:
        return "torch"
    if importlib.util.find_spec("mindspore") is not None:
        return "mindspore"
    raise RuntimeError(f"hyper_parallel needs PyTorch (or MindSpore) installed; neither was found. Set {_ENV} or install torch.")


def get_platform() -> Platform:
    """Return the process-wide platform singleton (created on first call)."""
    global _PLATFORM
    if _PLATFORM is None:
        name = _detect()
        if name == "torch":
            from hyper_parallel.platform.torch.platform import TorchPlatform
            _PLATFORM = TorchPlatform()
        else:
            raise NotImplementedError(
                f"{_ENV}=mindspore: the MindSpore platform is not implemented yet; use 'torch'")
    return _PLATFORM


__all__ = ["get_platform", "Platform", "PlatformType", "CommGroup"]
