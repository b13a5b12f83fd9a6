"""``hyper_parallel.fsdp.hsdp``: HyperParallel's ``hsdp``, an alias with no logic.

The code lives in :mod:`hyper_parallel.compat.hyperparallel.hsdp` (HyperParallel's API on this
package's mechanics); this path is that module (``sys.modules`` alias), so ``from hyper_parallel.fsdp.hsdp
import hsdp, HSDPModule`` and ``hyper_parallel.fsdp.hsdp`` work as before. The layers contract lists
this one upward import as a facade (pyproject.toml).
"""
import sys

from hyper_parallel.compat.hyperparallel import hsdp as _home

sys.modules[__name__] = _home
