"""Let ``torch.distributed.checkpoint.async_save``'s default stager copy hyper_parallel DTensors.

``async_save`` first copies the state dict to CPU with ``StateDictStager``, which
rebuilds every tensor from its storage (``new_empty`` + ``set_``). Our DTensor is a
storage-less wrapper whose ``data_ptr``/``untyped_storage`` answer for the local
shard, so that path would graft the local storage onto a global-shape wrapper. The
stager is taught one extra case instead: a tensor whose class defines
``__hp_stage__`` is staged by that method (DTensor stages its local tensor with the
stager's own copier and re-wraps it with the same mesh, layout and global shape).

The patch is applied when the stager module is imported (a meta-path hook, so that
importing hyper_parallel does not pay for importing DCP), or at once if it already is.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

_TARGET = "torch.distributed.checkpoint._state_dict_stager"


def _patch(module) -> None:
    cls: Any = getattr(module, "StateDictStager", None)
    orig = getattr(cls, "_offload_tensor", None)
    if orig is None or getattr(orig, "_hp_patched", False):
        return

    def _offload_tensor(self, x, memo, non_blocking=False):
        stage = getattr(type(x), "__hp_stage__", None)
        if stage is None:
            return orig(self, x, memo, non_blocking)
        y = stage(x, lambda local: self.deepcopy_with_tensor_offload(local, memo, non_blocking=non_blocking))
        memo[id(x)] = y
        return y

    _offload_tensor._hp_patched = True  # type: ignore[attr-defined]  # the idempotence mark
    cls._offload_tensor = _offload_tensor


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)
        loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Patch the stager now if it is loaded, else when it is (idempotent)."""
    if _TARGET in sys.modules:
        _patch(sys.modules[_TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
