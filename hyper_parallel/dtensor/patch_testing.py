"""``torch.testing`` on hyper_parallel DTensors: the same DTensor rule PyTorch applies to its own.

PyTorch 2.13's ``assert_close`` and ``TestCase.assertEqual`` pass both inputs through
``torch.testing._comparison._unwrap_dtensor_for_comparison``, which, for two
``torch.distributed.tensor.DTensor`` s, requires equal placements ("DTensor placements do not
match") and equal meshes, then compares the local shards. Its ``isinstance`` check does not
see our DTensor, so this module wraps that function once to apply the same rule to ours.
Other inputs (torch's DTensors, plain tensors, a DTensor mixed with a plain tensor) go to
PyTorch's function unchanged. Without that function (older torch) nothing is installed.
"""
from __future__ import annotations

import sys

_DTENSOR_CLASSES = []  # the core's DTensor class, injected (see register_dtensor_class)


def register_dtensor_class(cls) -> None:
    """Apply the DTensor rule to instances of ``cls`` (the core's DTensor; called once at import).

    The composition root (``hyper_parallel/__init__.py``) hands the class in. Idempotent.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_dtensor_class: cls must be a class, got {cls!r}")
    if cls not in _DTENSOR_CLASSES:
        _DTENSOR_CLASSES.append(cls)


def _ours(x):
    return any(isinstance(x, cls) for cls in _DTENSOR_CLASSES)


def _wrap(original):
    def unwrap_dtensor_for_comparison(actual, expected):
        if _ours(actual) and _ours(expected):
            if tuple(actual.placements) != tuple(expected.placements):
                raise AssertionError(f"DTensor placements do not match: {tuple(actual.placements)} != "
                                     f"{tuple(expected.placements)}")
            if actual.device_mesh != expected.device_mesh:
                raise AssertionError(f"DTensor device meshes do not match: {actual.device_mesh} != "
                                     f"{expected.device_mesh}")
            return actual.to_local(), expected.to_local()
        return original(actual, expected)
    unwrap_dtensor_for_comparison._hp_original = original
    return unwrap_dtensor_for_comparison


def install() -> bool:
    """Wrap ``_unwrap_dtensor_for_comparison`` where torch defines and imports it (idempotent)."""
    try:
        from torch.testing import _comparison
    except ImportError:  # pragma: no cover - torch without torch.testing
        return False
    original = getattr(_comparison, "_unwrap_dtensor_for_comparison", None)
    if original is None:
        return False
    if getattr(original, "_hp_original", None) is None:
        _comparison._unwrap_dtensor_for_comparison = _wrap(original)
    hooked = _comparison._unwrap_dtensor_for_comparison
    # common_utils binds the name at its import: rebind it if it was imported before us
    cu = sys.modules.get("torch.testing._internal.common_utils")
    if cu is not None and getattr(cu, "_unwrap_dtensor_for_comparison", None) is not hooked:
        cu._unwrap_dtensor_for_comparison = hooked
    return True


install()
