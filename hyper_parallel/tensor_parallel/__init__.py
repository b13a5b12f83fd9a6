"""Tensor and sequence parallelism: torch's parallel styles, ``parallelize_module`` and ``loss_parallel``.

Design (one screen)
-------------------
* **Styles are module transforms.** ``style.py``: ``ColwiseParallel``, ``RowwiseParallel``,
  ``SequenceParallel``, ``NoParallel``, ``PrepareModuleInput/Output/InputOutput`` (torch's arguments and
  defaults, HyperParallel's style names too). Each distributes the module's parameters and adds
  forward (pre-)hooks that redistribute inputs and outputs; the Megatron minimum of collectives per
  layer falls out of the dispatcher's partial-gradient views, not of special cases here.
* ``api.py``: ``parallelize_module`` (plans keyed by FQN patterns, multi-dim meshes for styles that
  declare ``accepts_nd_mesh``). ``loss.py``: ``loss_parallel`` (vocab-parallel cross entropy on a
  ``Shard(-1)`` logits DTensor, installed with ``dispatch.rules.base.override``).
* **Imports.** The ground floor, ``dtensor``, ``dispatch``. ``ParallelStyle`` is the public base class
  that ``context_parallel`` and ``moe`` subclass (the only imports other parallelisms make of this one).
* Docs: ``docs/tensor_parallel.md``.
"""
from hyper_parallel.tensor_parallel.style import (
    ParallelStyle, ColwiseParallel, RowwiseParallel, SequenceParallel, NoParallel,
    PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)
from hyper_parallel.tensor_parallel.api import parallelize_module
from hyper_parallel.tensor_parallel.loss import loss_parallel
