"""Stand-ins for private torch DTensor functions that swapped programs call (``hyper_parallel.swap``).

``torch.distributed.tensor._random.manual_seed(seed, device_mesh)``: torch 2.13's behaviour
(:func:`hyper_parallel.dtensor.random.torch_manual_seed`): on a CPU mesh random ops on DTensors draw
each local shard from the rank's default generator, as torch's do, so a torch program's
initialisation equals torch's; elsewhere the layout-independent stream seeded with ``seed``
(torch's per-shard Philox offsets are not reproduced; ``docs/torchtitan.md``, "Seeding").
"""
from __future__ import annotations

from hyper_parallel.dtensor.random import torch_manual_seed as _torch_manual_seed


def manual_seed(seed: int, device_mesh) -> None:
    """torch's ``torch.distributed.tensor._random.manual_seed`` (signature and behaviour)."""
    _torch_manual_seed(seed, device_mesh)


__all__ = ["manual_seed"]
