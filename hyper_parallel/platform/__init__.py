"""``hyper_parallel.platform.get_platform()``: HyperParallel's path, an alias with no logic.

The library has no platform indirection: its code imports torch where it needs torch, and the
ground floor (``hyper_parallel.distributed``) adapts torch.distributed. HyperParallel removed its
own platform layer in 2026-09; :mod:`hyper_parallel.compat.hyperparallel.platform` keeps the old call
working and says what it answers; this path is that module (``sys.modules`` alias).
"""
import sys

from hyper_parallel.compat.hyperparallel import platform as _home

sys.modules[__name__] = _home
