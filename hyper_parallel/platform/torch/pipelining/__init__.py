"""Pipeline-parallel mechanics on torch (a platform feature folder).

What it holds:

* :mod:`.stage` - :class:`~.stage.PipelineStage`, a subclass of torch's
  ``torch.distributed.pipelining.PipelineStage`` whose boundary activations and
  gradients may be hyper_parallel DTensors, and whose submodule may be a
  hyper_parallel ``FSDPModule``;
* :mod:`.schedules` - torch's schedules with argument checks in front of them
  (same runtime, same constructor arguments, subclasses of torch's classes),
  ``get_schedule_class`` and ``microbatch``.

The framework-neutral API is ``hyper_parallel.pipelining``; it reaches this folder by
``get_platform().feature("pipelining")``. Importing this package registers
:mod:`.api` under that name (the composition root imports every package in
``get_platform().feature_packages``).
"""
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.torch.pipelining import api

get_platform().register_feature("pipelining", api)

__all__ = ["api"]
