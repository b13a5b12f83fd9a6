"""Distributed checkpoints of hyper_parallel models: state-dict helpers for ``torch.distributed.checkpoint``.

Save and load with DCP itself (its engine and file format), using these helpers to
get FQN-keyed state dicts that reshard on load::

    import torch.distributed.checkpoint as dcp
    from hyper_parallel.checkpoint import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    # ... later, in any parallel layout / world size:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    # or hyper_parallel.checkpoint.load(...): the same after checking keys and shapes on every rank
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

hyper_parallel DTensors work with ``dcp.save``/``load``/``async_save`` directly (see
``docs/checkpoint.md``); their hooks are in ``dcp.py``, ``async_save``'s DTensor copy in ``staging.py``,
the state-dict helpers in ``state_dict.py``. This package imports only torch and the ground floor
(DTensors are recognised by duck typing), so the DTensor class may call into ``dcp.py``.
"""
from hyper_parallel.checkpoint.state_dict import (IncompatibleKeys, StateDictOptions, get_model_state_dict,
                                                 get_optimizer_state_dict, get_state_dict, load,
                                                 set_model_state_dict, set_optimizer_state_dict, set_state_dict)

__all__ = ["StateDictOptions", "IncompatibleKeys", "load", "get_state_dict", "set_state_dict", "get_model_state_dict",
           "set_model_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict"]
