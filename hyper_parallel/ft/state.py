"""State dicts for healing: our DTensors' local shards and their layouts, for model, optimizer, RNG and data.

torchft's ``PGTransport`` moves *torch* DTensors (``isinstance``, ``._local_tensor``, ``._spec``) and
plain tensors; hyper_parallel's DTensor is not a torch DTensor. So the state handed to torchft holds
plain local tensors (this rank's shard, copied) and, next to them, each tensor's layout as plain data
(global shape, placements, mesh shape). A healing rank receives the live group's rank-``r`` state
and copies every shard into its own DTensor in place, after checking that the layouts are equal: a
group with another inner layout (another mesh or sharding) would otherwise load a different piece of
each tensor, a silent wrong number, so it gets an error naming the first differing tensor.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from hyper_parallel.dtensor.dtensor import DTensor


def layout_of(tensor: torch.Tensor) -> tuple:
    """Plain-data description of how ``tensor`` is laid out on this rank (equal iff the shards correspond)."""
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        return ("dtensor", tuple(tensor.shape), str(tensor.dtype), tuple(mesh.mesh.shape),
                tuple(repr(p) for p in tensor.placements), tuple(tensor._local_tensor.shape))
    return ("tensor", tuple(tensor.shape), str(tensor.dtype))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _check_layouts(what: str, mine: Dict[str, tuple], theirs: Dict[str, tuple]) -> None:
    if mine.keys() != theirs.keys():
        missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
        raise ValueError(f"hyper_parallel.ft heal: the live replica group's {what} differs from this group's: "
                         f"missing {missing[:5]}, unexpected {extra[:5]}; every replica group must train the "
                         "same model")
    for key, lay in mine.items():
        if theirs[key] != lay:
            raise ValueError(f"hyper_parallel.ft heal: {what} entry {key!r} is laid out as {theirs[key]} in the live "
                             f"replica group but as {lay} here; every replica group must use the same model and the "
                             "same inner layout (mesh shape and placements), since torchft pairs rank r of each "
                             "group and moves local shards")


# ---------------------------------------------------------------------------------------------- model
def model_state(model: torch.nn.Module) -> dict:
    """``{"tensors": {fqn: local shard copy}, "layouts": {fqn: layout}}`` of parameters and buffers."""
    sd = model.state_dict()
    return {"tensors": {k: _local(v).detach().clone() for k, v in sd.items()},
            "layouts": {k: layout_of(v) for k, v in sd.items()}}


def load_model_state(model: torch.nn.Module, state: dict) -> None:
    """Copy a :func:`model_state` from a live group into ``model``'s shards, in place, layouts checked."""
    sd = model.state_dict()
    _check_layouts("model state", {k: layout_of(v) for k, v in sd.items()}, state["layouts"])
    with torch.no_grad():
        for k, v in sd.items():
            _local(v).copy_(state["tensors"][k])


# ------------------------------------------------------------------------------------------ optimizer
def optimizer_state(optim: torch.optim.Optimizer) -> dict:
    """The optimizer's ``state_dict`` with every DTensor replaced by its local shard (+ its layout)."""
    sd = optim.state_dict()
    state, layouts = {}, {}
    for pid, entry in sd["state"].items():
        state[pid] = {}
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                layouts[f"{pid}.{name}"] = layout_of(value)
                value = _local(value).detach().clone()
            state[pid][name] = value
    return {"state": state, "param_groups": sd["param_groups"], "layouts": layouts}


def load_optimizer_state(optim: torch.optim.Optimizer, saved: dict) -> None:
    """Load an :func:`optimizer_state`: each shard back into a DTensor laid out like its parameter."""
    params = [p for group in optim.param_groups for p in group["params"]]
    state = {}
    layouts = {}
    for pid, entry in saved["state"].items():
        param = params[int(pid)]
        state[pid] = {}
        for name, value in entry.items():
            key = f"{pid}.{name}"
            if isinstance(value, torch.Tensor) and saved["layouts"][key][0] == "dtensor":
                value = DTensor.from_local(value.to(_local(param).device), param.device_mesh, param.placements,
                                           shape=param.shape, stride=param.stride())
            if isinstance(value, torch.Tensor):
                layouts[key] = layout_of(value)
            state[pid][name] = value
    _check_layouts("optimizer state", layouts, saved["layouts"])
    optim.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


# ------------------------------------------------------------------------------------------------ RNG
def rng_state() -> dict:
    """This rank's torch generator(s) and the DTensor random stream's position."""
    from hyper_parallel.dtensor import random as hp_random
    out = {"cpu": torch.get_rng_state(), "dtensor": dict(hp_random.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def load_rng_state(state: dict) -> None:
    from hyper_parallel.dtensor import random as hp_random
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    hp_random.set_rng_state(dict(state["dtensor"]))


# ----------------------------------------------------------------------------------------- registration
def register_healing(manager, model: torch.nn.Module, optim: torch.optim.Optimizer,
                     data_state: Optional[Callable[[], dict]] = None,
                     load_data_state: Optional[Callable[[dict], None]] = None) -> None:
    """Register model, optimizer, RNG and data-position state with the Manager (what a healing group receives).

    ``optim`` is the inner optimizer (not the :class:`FTOptimizer` wrapper). ``data_state`` /
    ``load_data_state``: the data position (default: none beyond the Manager's step, which torchft
    moves itself).
    """
    def deferred(load):
        # a layout mismatch is kept, not raised inside torchft's quorum: the group would die there and the live
        # group wait for it until the quorum timeout; check_same_model raises it on every group at once instead
        def run(state):
            if getattr(manager, "_hp_heal_error", None) is not None:
                return
            try:
                load(state)
            except ValueError as exc:
                manager._hp_heal_error = exc
        return run
    manager._hp_heal_error = None
    manager._hp_fingerprint = model_fingerprint(model)
    manager.register_state_dict_fn("model", deferred(lambda s: load_model_state(model, s)), lambda: model_state(model))
    manager.register_state_dict_fn("optim", deferred(lambda s: load_optimizer_state(optim, s)),
                                   lambda: optimizer_state(optim))
    manager.register_state_dict_fn("rng", deferred(load_rng_state), rng_state)
    if data_state is not None:
        manager.register_state_dict_fn("data", deferred(load_data_state), data_state)


def model_fingerprint(model: torch.nn.Module) -> int:
    """A 62-bit hash of the model's state names, global shapes, dtypes and this rank's layouts."""
    import hashlib
    sd = model.state_dict()
    text = repr(sorted((k, layout_of(v)) for k, v in sd.items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def check_same_model(manager) -> None:
    """At each new quorum of several groups: every group checks that all hold the same model and layout.

    One small all_reduce (MAX of ``[fingerprint, -fingerprint, heal failed]``) over the groups: all of
    them see a mismatch (or a heal that found different layouts) and raise the same ``ValueError``,
    in bounded time, before any gradient is averaged.
    """
    from torch.distributed import ReduceOp
    quorum = getattr(manager, "_quorum_id", None)
    if manager.num_participants() < 2 or quorum == getattr(manager, "_hp_checked_quorum", None):
        return
    fp = getattr(manager, "_hp_fingerprint", None)
    if fp is None:
        return
    err = getattr(manager, "_hp_heal_error", None)
    probe = torch.tensor([fp, -fp, 1 if err is not None else 0], dtype=torch.int64)
    allreduce = getattr(manager, "_hp_uncounted_allreduce", manager.allreduce)  # 24 bytes per new quorum
    allreduce(probe, reduce_op=ReduceOp.MAX).wait()
    if manager.errored() is not None:
        return  # a peer died during the check: this step is not committed, the next quorum checks again
    manager._hp_checked_quorum = quorum
    if err is not None:
        raise err
    if int(probe[0]) != -int(probe[1]) or int(probe[2]):
        raise ValueError("hyper_parallel.ft: the replica groups in the quorum do not hold the same model: their "
                         "parameter names, shapes, dtypes or inner layouts (mesh shape, placements) differ, or a "
                         "group failed to heal from this one; every replica group must train the same model with "
                         "the same inner layout (torchft pairs rank r of each group and moves local shards)")


def state_digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> Dict[str, str]:
    """SHA-256 of this rank's model shards, optimizer state and RNG (bit-exact comparisons across groups)."""
    import hashlib

    def digest(tensors):
        h = hashlib.sha256()
        for t in tensors:
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]
    m = model_state(model)["tensors"]
    o = optimizer_state(optim)["state"]
    r = rng_state()
    return {"model": digest(m[k] for k in sorted(m)),
            "optim": digest(v for pid in sorted(o) for _, v in sorted(o[pid].items()) if isinstance(v, torch.Tensor)),
            "rng": digest([r["cpu"]]) + f":{r['dtensor']}"}
