"""Stand-ins for private torch DTensor functions that swapped programs call (``hyper_parallel.swap``).

``torch.distributed.tensor._random.manual_seed(seed, device_mesh)``: seeds hyper_parallel's DTensor
random stream (:func:`hyper_parallel.manual_seed`). The stream is reproducible and independent of the
layout, but it is not torch's Philox offset scheme: the same seed gives other numbers than torch's
tracker (``docs/torchtitan.md``, "Seeding").
"""
from __future__ import annotations

from hyper_parallel.dtensor.random import manual_seed as _hp_manual_seed


def manual_seed(seed: int, device_mesh=None) -> None:
    """torch's ``torch.distributed.tensor._random.manual_seed`` signature on hyper_parallel's stream."""
    _hp_manual_seed(int(seed))


__all__ = ["manual_seed"]
