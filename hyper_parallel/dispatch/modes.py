"""Dispatch switches and flags (public home): strict layouts, implicit replication, replicate
fallback, debug logging, SkipDTensorDispatch and HyperParallel's no-skip set.

State only: this module imports nothing of the dispatcher; the dispatcher reads the
flags here on every call and registers (:func:`on_switch_change`) the function that
clears its caches when a switch that changes cached answers is flipped.
``implicit_replication`` and ``SkipDTensorDispatch`` are the very objects of
``dtensor/skip_and_replication.py`` (the DTensor layer needs them too).

**Strict layouts.**

``strict_layouts`` decides what the dispatcher does when an op's sharding rule
needs an input redistributed *implicitly* (a sharded tensor dim gathered or
moved to another dim, see :mod:`hyper_parallel.dispatch.strict_layouts`):

* off (default, PyTorch's behaviour): redistribute silently;
* strict: raise HyperParallel's exception type (``ValueError``; ``NotImplementedError``
  for ring-attention layouts of ``scaled_dot_product_attention``) naming the op,
  the dim and the layouts;
* warn-only: redistribute, and warn (:class:`ImplicitRedistributionWarning`) once
  per (op, layouts) with the bytes the redistribution sends.

The state is process-global (like ``torch.set_grad_enabled``'s setter form, not
per thread). Its initial value comes from ``HYPER_PARALLEL_STRICT_LAYOUTS``:
``1``/``true``/``on``/``strict`` -> strict, ``warn`` -> warn-only, unset/empty/``0``/
``false``/``off`` -> off; any other value raises ``ValueError`` at import.
"""
from __future__ import annotations

import os
from typing import Callable

from hyper_parallel.dtensor import skip_and_replication as _ds
from hyper_parallel.dtensor.skip_and_replication import (  # noqa: F401  (public home of these names)
    SkipDTensorDispatch, add_no_skip_ops, disable_dtensor_dispatch, enable_dtensor_dispatch, get_dtensor_dispatch,
    get_no_skip_ops,
    implicit_replication, remove_no_skip_ops)

OFF, STRICT, WARN = 0, 1, 2
_NAMES = {OFF: "off", STRICT: "strict", WARN: "warn"}
ENV_VAR = "HYPER_PARALLEL_STRICT_LAYOUTS"
_ENV_VALUES = {"": OFF, "0": OFF, "false": OFF, "no": OFF, "off": OFF,
               "1": STRICT, "true": STRICT, "yes": STRICT, "on": STRICT, "strict": STRICT,
               "warn": WARN, "warn_only": WARN, "warn-only": WARN}


def _mode_from_env(environ=os.environ) -> int:
    """The mode ``HYPER_PARALLEL_STRICT_LAYOUTS`` asks for (OFF, STRICT or WARN)."""
    raw = environ.get(ENV_VAR, "")
    mode = _ENV_VALUES.get(raw.strip().lower())
    if mode is None:
        raise ValueError(f"{ENV_VAR}={raw!r} is not understood; expected one of 1/true/on/strict (raise), "
                         "warn (warn only) or 0/false/off/empty (PyTorch's behaviour, the default)")
    return mode


# STATE[0] is read by the dispatcher on every call that needs a redistribution (one list index)
STATE = [_mode_from_env()]
# (op, layouts) the warn-only mode has warned about (dispatch/strict_layouts.py)
STRICT_WARNED: set = set()


class ImplicitRedistributionWarning(UserWarning):
    """Warn-only strict layouts: an op redistributed an input implicitly (shown once per op and layouts)."""


class StrictLayoutError(ValueError, RuntimeError):
    """Strict layouts: an op would have to redistribute a sharded dim implicitly.

    A ``ValueError`` as in HyperParallel, and a ``RuntimeError`` as this library's
    strict mode raised before (code catching either keeps working).
    """


class StrictLayoutNotImplementedError(NotImplementedError, StrictLayoutError):
    """Strict layouts, ring-attention layouts of ``scaled_dot_product_attention`` (K/V sharded on the
    sequence, or the last (embedding) dim sharded): HyperParallel's ``NotImplementedError``."""


def _check_flag(name, value):
    if not isinstance(value, bool) and not (isinstance(value, int) and value in (0, 1)):
        raise TypeError(f"strict_layouts: {name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


class strict_layouts:
    """Strict layouts switch: a global setter and a context manager in one.

    ``hp.strict_layouts()`` / ``hp.strict_layouts(True)`` turn strict mode on for
    the process, ``hp.strict_layouts(False)`` turns it off, ``warn_only=True``
    selects the warn-only variant. Used as ``with hp.strict_layouts(...):`` the
    previous mode is restored on exit (nestable).
    """

    def __init__(self, enabled: bool = True, *, warn_only: bool = False):
        enabled = _check_flag("enabled", enabled)
        warn_only = _check_flag("warn_only", warn_only)
        self.prev = STATE[0]
        self.mode = (WARN if warn_only else STRICT) if enabled else OFF
        STATE[0] = self.mode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        STATE[0] = self.prev

    def __repr__(self):
        return f"strict_layouts(mode={_NAMES[self.mode]!r})"


def set_strict_layouts(enabled: bool = True, *, warn_only: bool = False) -> None:
    """Global setter form of :class:`strict_layouts` (kept for existing code)."""
    strict_layouts(enabled, warn_only=warn_only)


def strict_layouts_mode() -> str:
    """The current mode: ``"off"``, ``"strict"`` or ``"warn"``."""
    return _NAMES[STATE[0]]


def _debug_from_env(environ=os.environ) -> bool:
    """``HYPER_PARALLEL_DEBUG`` set to anything but empty/``0``/``false`` turns debug logging on."""
    return environ.get("HYPER_PARALLEL_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


# read by the dispatcher: "fallback" on a cache miss without a rule, "debug" when a miss redistributes
FLAGS = {"fallback": False, "debug": _debug_from_env()}
WARNED_FALLBACK: set = set()  # ops the replicate fallback has warned about
_ON_CHANGE: list = []


def on_switch_change(callback: Callable[[], None]) -> None:
    """Call ``callback()`` whenever a switch that changes cached dispatch answers is flipped (the dispatcher's
    cache clearing)."""
    if not callable(callback):
        raise TypeError(f"on_switch_change: callback must be callable, got {callback!r}")
    _ON_CHANGE.append(callback)


def _changed() -> None:
    for fn in _ON_CHANGE:
        fn()


def allow_replicate_fallback(enabled: bool = True) -> None:
    """Run ops without a rule replicated (inputs gathered), warning once per op.

    Every call starts afresh: ops that warned before warn again once.
    """
    FLAGS["fallback"] = bool(enabled)
    WARNED_FALLBACK.clear()
    _changed()


def set_debug(enabled: bool = True) -> None:
    """Log every redistribution the dispatcher inserts (logger ``hyper_parallel.dispatch``)."""
    FLAGS["debug"] = bool(enabled)
    _changed()


def _reset() -> None:
    """Back to the environment's modes (test harness) and forget which warnings were shown."""
    STATE[0] = _mode_from_env()
    STRICT_WARNED.clear()
    WARNED_FALLBACK.clear()
    _ds.IMPLICIT_REPLICATION[0] = False
    if FLAGS["fallback"]:
        allow_replicate_fallback(False)
    if FLAGS["debug"] != _debug_from_env():
        set_debug(_debug_from_env())


def reset_process_state() -> None:
    """Forget per-process state between independent jobs in one process: the dispatch modes go back to
    the environment's, and the layout-independent random stream (``hp.manual_seed``) is unseeded.

    The test harness calls it between tasks and ``hyper_parallel.auto.dry_run`` between fake worlds.
    """
    from hyper_parallel.dtensor import random as _random
    _random.reset_seed_state()
    _reset()


__all__ = ["reset_process_state", "strict_layouts", "set_strict_layouts", "strict_layouts_mode", "StrictLayoutError",
           "StrictLayoutNotImplementedError", "ImplicitRedistributionWarning", "implicit_replication",
           "allow_replicate_fallback", "set_debug", "SkipDTensorDispatch", "add_no_skip_ops", "remove_no_skip_ops",
           "get_no_skip_ops", "disable_dtensor_dispatch", "enable_dtensor_dispatch", "get_dtensor_dispatch",
           "on_switch_change"]
