"""FSDP policies (framework-free value objects, PyTorch FSDP2 names and fields).

``MixedPrecisionPolicy`` says in which dtype parameters are all-gathered and
used in compute (``param_dtype``), in which dtype gradients are reduced
(``reduce_dtype``), what the module's floating outputs are cast to
(``output_dtype``) and whether floating forward inputs are cast to
``param_dtype`` (``cast_forward_inputs``). ``None`` keeps the original dtype.
The sharded master parameters and the optimizer always stay in their original
(usually fp32) dtype.

``OffloadPolicy`` (the default) keeps sharded parameters on the compute device;
``CPUOffloadPolicy`` keeps them (and their gradients and the optimizer step) on
the CPU and copies shards to the device for each all_gather. On a CPU-only
machine the two are the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: Optional[Any] = None
    reduce_dtype: Optional[Any] = None
    output_dtype: Optional[Any] = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading: sharded parameters stay where the module is."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, gradients and the optimizer step on the CPU.

    ``pin_memory`` pins the CPU shards so the host-to-device copies before each
    all_gather can be asynchronous (ignored when no accelerator is present).
    """
    pin_memory: bool = True
