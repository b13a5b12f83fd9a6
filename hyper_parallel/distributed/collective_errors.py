"""Faults of collectives, framework-free: the errors, the collective timeout, the desync-check switch.

* :class:`CollectiveError` (a ``RuntimeError``) is what a collective the library issues raises when
  it fails: a peer died (its connection closed), the collective timed out, or the backend refused
  it. The message names the collective, the group's ranks and, where known, the mesh dim and the
  peer; the backend's own error is chained (``__cause__``) and quoted.
* :class:`CollectiveMismatchError` (a :class:`CollectiveError`) is raised on every rank of a group
  by the opt-in check (:func:`set_check_collectives`) when the ranks are about to issue different
  collectives; it carries each rank's description.
* The collective timeout, one value: ``HYPER_PARALLEL_COLLECTIVE_TIMEOUT`` seconds (the older name
  ``HYPER_PARALLEL_TIMEOUT`` is still read), or :func:`set_collective_timeout`, default 600 s. The
  ground floor applies it to the groups it creates, to the default group it initialises and, once set
  explicitly (environment or setter), to every group the library uses.

Wrapping torch's errors and applying the timeout to groups live in ``collective_guard.py`` beside
this module.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

TIMEOUT_ENV = "HYPER_PARALLEL_COLLECTIVE_TIMEOUT"
LEGACY_TIMEOUT_ENV = "HYPER_PARALLEL_TIMEOUT"
CHECK_ENV = "HYPER_PARALLEL_CHECK_COLLECTIVES"
DEFAULT_TIMEOUT_S = 600.0


class CollectiveError(RuntimeError):
    """A collective issued by hyper_parallel failed (dead peer, timeout, backend error).

    Attributes: ``op`` (the collective), ``ranks`` (the group's global ranks), ``where`` (mesh dims
    of the group, or None), ``peer`` (the peer's global rank for point-to-point, else None),
    ``reason`` (``"peer closed"``, ``"timeout"``, ``"mismatch"`` or ``"error"``).
    """

    def __init__(self, message, *, collective=None, ranks=None, where=None, peer=None, reason="error"):
        super().__init__(message)
        self.op, self.ranks, self.where, self.peer, self.reason = collective, ranks, where, peer, reason


class CollectiveMismatchError(CollectiveError):
    """Ranks of one group were about to issue different collectives (raised on every rank of the group).

    ``descriptions`` maps each global rank to its description (op, group, shape, dtype, placements,
    call site).
    """

    def __init__(self, message, *, descriptions=None, **fields):
        fields.setdefault("reason", "mismatch")
        super().__init__(message, **fields)
        self.descriptions = descriptions or {}


def _parse_timeout(value, what):
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}={value!r} is not a number of seconds; expected a positive number") from None
    if not s > 0 or s != s or s == float("inf"):
        raise ValueError(f"{what}={value!r}: expected a positive, finite number of seconds")
    return s


def _env_timeout():
    for name in (TIMEOUT_ENV, LEGACY_TIMEOUT_ENV):
        v = os.environ.get(name)
        if v not in (None, ""):
            return _parse_timeout(v, name)
    return None


def _env_check() -> bool:
    v = os.environ.get(CHECK_ENV, "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{CHECK_ENV}={v!r}: expected 1/0 (or true/false, yes/no, on/off)")


_explicit_timeout = [None]   # set_collective_timeout's value (wins over the environment)
_listeners = []              # the group code's: called with the new timeout when it is set
CHECK = [_env_check()]       # read on every collective: a list item is the cheapest switch


def collective_timeout() -> float:
    """The collective timeout in seconds (setter, else environment, else 600)."""
    if _explicit_timeout[0] is not None:
        return _explicit_timeout[0]
    env = _env_timeout()
    return DEFAULT_TIMEOUT_S if env is None else env


def timeout_is_explicit() -> bool:
    """Whether the timeout was chosen (setter or environment) rather than defaulted."""
    return _explicit_timeout[0] is not None or _env_timeout() is not None


def set_collective_timeout(seconds) -> None:
    """Set the timeout (seconds) of every collective the library issues, now and later.

    Applied at once to every process group the library has created or used (the default group
    included), and to the groups it creates afterwards. ``None`` goes back to the environment's
    value (or the default, 600 s) for groups created afterwards.
    """
    if seconds is None:
        _explicit_timeout[0] = None
        return
    if isinstance(seconds, bool):
        raise ValueError(f"set_collective_timeout: seconds={seconds!r}: expected a positive number of seconds")
    _explicit_timeout[0] = _parse_timeout(seconds, "set_collective_timeout: seconds")
    for fn in list(_listeners):
        fn(_explicit_timeout[0])


def on_timeout_change(callback) -> None:
    """The group code (groups.py) registers ``callback(seconds)``, called by :func:`set_collective_timeout`."""
    if callback not in _listeners:
        _listeners.append(callback)


def check_collectives_enabled() -> bool:
    return CHECK[0]


def set_check_collectives(enabled: bool = True) -> None:
    """Turn the desynchronisation check on or off (``HYPER_PARALLEL_CHECK_COLLECTIVES`` sets the start value)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_check_collectives: enabled={enabled!r}: expected True or False")
    CHECK[0] = enabled


@contextmanager
def check_collectives(enabled: bool = True):
    """``with check_collectives():`` checks every collective issued inside the block (then restores)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"check_collectives: enabled={enabled!r}: expected True or False")
    old = CHECK[0]
    CHECK[0] = enabled
    try:
        yield
    finally:
        CHECK[0] = old


def reset() -> None:
    """Back to the environment's settings (for tests)."""
    _explicit_timeout[0] = None
    CHECK[0] = _env_check()


__all__ = ["CollectiveError", "CollectiveMismatchError", "collective_timeout", "set_collective_timeout",
           "check_collectives", "set_check_collectives", "check_collectives_enabled", "TIMEOUT_ENV", "CHECK_ENV",
           "DEFAULT_TIMEOUT_S"]
