"""Distributed checkpoints of hyper_parallel DTensors on torch (a platform feature folder).

What it holds:

* :mod:`.dcp` - the ``torch.distributed.checkpoint`` extension hooks of a DTensor
  (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``):
  each rank writes its one box, replicated data once;
* :mod:`.staging` - teaches ``async_save``'s default stager to copy a DTensor (it
  rebuilds tensors from storage, which our storage-less wrapper has not);
* :mod:`.state_dict` - the helpers behind ``hyper_parallel.checkpoint``
  (``get_state_dict`` / ``set_state_dict`` / ``save`` / ``load``, optimizer state keyed
  by parameter name, full state dicts, broadcast from rank 0).

Why a folder of its own: these are feature mechanics on top of torch's DCP, not an
adaptation of torch's basic services, which stay at the root of ``platform/torch/``.

Layering: this folder imports nothing from ``hyper_parallel.core`` (or ``checkpoint``,
``debug``, the package root): DTensors are recognised by duck typing (``__hp_stage__``,
``_hp_fsdp_state``). The core and ``hyper_parallel.checkpoint`` reach it through
``get_platform().checkpoint_hooks()`` / ``checkpoint_state_dict()``.
"""
