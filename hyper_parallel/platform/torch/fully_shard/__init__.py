"""``fully_shard`` / ``hsdp`` mechanics on torch (a platform feature folder).

What it holds:

* :mod:`.param` - one managed parameter: its sharded DTensor, its unsharded leaf and
  its place in the group's flat buffer;
* :mod:`.param_group` - a module's parameter group: one flat all_gather (unshard) and
  one flat reduce_scatter / all_reduce (gradients) per group, asynchronous;
* :mod:`.state` - per-module state, the forward/backward hooks with prefetching, the
  root's end-of-backward callback, and the mechanics entry points
  (``fully_shard``, ``replicate_small``, ``scale_grads``).

Why a folder of its own: this is feature mechanics, not an adaptation of torch's basic
services (which stay at the root of ``platform/torch/`` and import nothing from the
core). It builds DTensors, so - alone in the platform - it imports ``hyper_parallel.core``;
nothing in the platform imports it back.

Home of the API: ``hyper_parallel/core/fsdp/`` (``fully_shard``, ``FSDPModule``,
``hsdp``) validates every argument and plans which parameters are sharded on which dim;
this folder only carries the plan out. The core reaches it by
``get_platform().feature("fully_shard")``: importing this package registers
:mod:`.state` under that name, and the composition root (``hyper_parallel/__init__.py``)
imports every package in ``get_platform().feature_packages``.
"""
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.torch.fully_shard import state

get_platform().register_feature("fully_shard", state)

__all__ = ["state"]
