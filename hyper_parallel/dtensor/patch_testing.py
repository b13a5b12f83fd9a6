"""``torch.testing`` on hyper_parallel DTensors: the same DTensor rule PyTorch applies to its own.

PyTorch 2.13's ``assert_close`` and ``TestCase.assertEqual`` pass both inputs through
``torch.testing._comparison._unwrap_dtensor_for_comparison``, which, for two
``torch.distributed.tensor.DTensor`` s, requires equal placements ("DTensor placements do not
match") and equal meshes, then compares the local shards, and for a DTensor mixed with anything
else raises ``TypeError`` ("Comparing a DTensor to a non-DTensor is ambiguous..."), in both
argument orders. Its ``isinstance`` check does not see our DTensor, so this module wraps that
function once to apply the same rules to ours (one of ours mixed with a plain tensor, a number,
a sequence or torch's DTensor: the same ``TypeError``). Inputs that hold none of ours go to
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


def _ours(obj):
    return any(isinstance(obj, cls) for cls in _DTENSOR_CLASSES)


_MIXED = ("Comparing a DTensor to a non-DTensor is ambiguous. Call .full_tensor() to compare the full logical "
          "tensor or .to_local() to compare the local shard.")  # torch 2.13's text, word for word


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
        if _ours(actual) or _ours(expected):
            # one of ours and anything else (a plain tensor, a number, a list, torch's DTensor):
            # torch 2.13 refuses the mix for its own DTensor, with this TypeError
            raise TypeError(_MIXED)
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
