"""Step checkpoints for the example trainer: DCP directories under one root plus a ``latest`` marker.

    DIR/step-000010/     one torch.distributed.checkpoint directory per saved step
    DIR/step-000020/
    DIR/latest           "step-000020", rewritten (atomically) only after that save completed

A save that dies part way (a killed rank, a full disk) leaves a partial step directory
behind, without ``.metadata``, and ``latest`` still names the previous complete one.
``dcp.save`` returns on every rank only after rank 0 has written the directory's
``.metadata`` (its last act), so the marker is written after that and a barrier.

Resume picks a *complete* step directory (one holding ``.metadata``; a directory without it
is never picked): the one ``latest`` names if that is complete, else the newest complete
``step-NNNNNN``. Rank 0 chooses and broadcasts the name, so every rank loads the same one. Besides model and optimizer
a checkpoint holds what makes a resumed run bit-exact in the same layout: the data position
(``data.seed``, ``data.next_step``: batches are a pure function of seed and step) and every
rank's RNG state (``rng/<rank>/cpu``, ``rng/<rank>/cuda``, restored when the world size is the
saved one; under another layout the generators are left alone) and the DTensor random stream's
position (``dtensor_rng.seed``, ``dtensor_rng.offset``: the same on every rank and for every layout,
so always restored).

State dicts come from :mod:`hyper_parallel.checkpoint` (keys are parameter FQNs),
so a checkpoint saved under one ``--dp/--tp`` layout resumes under any other, or
in one process.
"""
from __future__ import annotations

import os
import re
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hyper_parallel.checkpoint import get_state_dict, load as checked_load, set_state_dict
from hyper_parallel.core.dtensor import random as hp_random

LATEST = "latest"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def is_complete(path: str) -> bool:
    """A DCP directory is complete once ``.metadata`` exists (``dcp.save`` writes it last)."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def latest_dir(root: str) -> Optional[str]:
    """The complete step directory to resume from under ``root`` (None if there is none).

    The one ``latest`` names, if it is complete (the normal case: ``save`` rewrites the marker
    after each complete save; a person may point it at an earlier step). Otherwise (no marker,
    or it names a directory without ``.metadata``) the newest complete ``step-NNNNNN``. A step
    directory without ``.metadata`` (a save that died part way) is never returned.
    """
    if not os.path.isdir(root):
        return None
    marker = os.path.join(root, LATEST)
    if os.path.isfile(marker):
        with open(marker) as f:
            named = os.path.join(root, f.read().strip())
        if _STEP_DIR.match(os.path.basename(named)) and is_complete(named):
            return named
    steps = sorted(((int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP_DIR.match(name))),
                   reverse=True)
    for _, name in steps:
        if is_complete(os.path.join(root, name)):
            return os.path.join(root, name)
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict:
    """This rank's generator states under rank-specific keys (DCP keeps one copy per key)."""
    r = _rank()
    out = {f"rng/{r}/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng/{r}/cuda"] = torch.cuda.get_rng_state()
    return out


# The DTensor random stream (hyper_parallel.manual_seed; random ops on sharded DTensors, attention dropout
# on DTensors): one (seed, offset) for all ranks. The seed is stored as text: it may not fit an int64.
DTENSOR_RNG = "dtensor_rng"


def _dtensor_rng_state() -> dict:
    st = hp_random.get_rng_state()
    return {"seed": "" if st["seed"] is None else str(st["seed"]), "offset": int(st["offset"])}


def _set_dtensor_rng_state(saved: dict) -> None:
    seed = saved["seed"]
    hp_random.set_rng_state({"seed": int(seed) if seed != "" else None, "offset": int(saved["offset"])})


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def save(root: str, step: int, model, optimizer, data_seed: Optional[int] = None) -> str:
    """Save model + optimizer after ``step`` completed steps (collective); returns the step directory.

    With ``data_seed`` the data position (``data.seed``, ``data.next_step``) is saved too; every
    rank's RNG state always is.
    """
    path = step_dir(root, step)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": step, GROUPS: _groups_by_fqn(optim_sd), "rng_world": _world(), **_rng_state()}
    state[DTENSOR_RNG] = _dtensor_rng_state()
    if data_seed is not None:
        state["data"] = {"seed": int(data_seed), "next_step": step}
    dcp.save(state, checkpoint_id=path)
    _barrier()
    if _rank() == 0:
        tmp = os.path.join(root, f".{LATEST}.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(path) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, LATEST))
    _barrier()
    return path


def load(path: str, model, optimizer, data_seed: Optional[int] = None, *, stage: bool = False) -> int:
    """Load a step directory into ``model``/``optimizer`` in their current layout; returns its step.

    Restores this rank's RNG state when the checkpoint has it and was saved at this world size.
    With ``data_seed``, a checkpoint that recorded a different data seed is refused.
    ``stage=True`` (pipeline stages, ``--pp``): ``model`` holds only some of the checkpoint's parameters;
    the others are not read (every key of ``model`` must still be in the checkpoint).
    """
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata)")
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": -1}
    if _has_groups_by_fqn(path):
        state[GROUPS] = _groups_by_fqn(optim_sd)
    # the extras, all of them (the strict check wants every key; every rank's RNG state is a few KB)
    state.update({k: torch.empty(tuple(md.size), dtype=torch.uint8) for k, md in saved.items() if k.startswith("rng/")})
    if any(k.startswith(DTENSOR_RNG + ".") for k in saved):  # older checkpoints do not have it
        state[DTENSOR_RNG] = {"seed": "", "offset": -1}
    for k in ("rng_world", "data.seed", "data.next_step"):
        if k in saved:
            state.setdefault(k.split(".")[0], {} if "." in k else -1)
            if "." in k:
                state["data"][k.split(".")[1]] = -1
    if stage:  # shapes checked first; a key missing from the checkpoint fails DCP's planning on every rank
        checked_load(state, checkpoint_id=path, strict=False, planner=dcp.DefaultLoadPlanner(allow_partial_load=False))
    else:
        checked_load(state, checkpoint_id=path)  # keys and shapes checked on every rank first
    if GROUPS in state:  # --- pipeline stages: each rank's param_groups name only its stages' parameters
        optim_sd["param_groups"] = [{**hyper, "params": [fqn]} for fqn, hyper in state[GROUPS].items()]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if data_seed is not None and "data" in state and state["data"]["seed"] != data_seed:
        raise ValueError(f"{path} was saved with data seed {state['data']['seed']}, this run uses {data_seed}; "
                         "the resumed batches would differ")
    if state.get("rng_world") == _world():
        for k in _rng_state():
            if k in state:
                (torch.set_rng_state if k.endswith("/cpu") else torch.cuda.set_rng_state)(state[k])
    if DTENSOR_RNG in state:
        _set_dtensor_rng_state(state[DTENSOR_RNG])
    return int(state["step"])


# --- pipeline parallelism (--pp): optimizer hyperparameters per parameter FQN. A rank of a pipeline holds
# only its stages' parameters, so its ``param_groups`` list names only those; DCP keeps one rank's copy of
# such a non-tensor entry, which would lose the other stages' names. Keyed by FQN, every name is written by
# a rank that has it and read back by whichever rank needs it, at any --pp.
GROUPS = "optim_groups"


def _groups_by_fqn(optim_sd) -> dict:
    return {fqn: {k: v for k, v in g.items() if k != "params"}
            for g in optim_sd["param_groups"] for fqn in g["params"]}


def _has_groups_by_fqn(path: str) -> bool:
    """Whether the checkpoint at ``path`` has the per-FQN hyperparameters (older checkpoints do not)."""
    meta = dcp.FileSystemReader(path).read_metadata()
    return any(k.startswith(GROUPS + ".") for k in meta.state_dict_metadata)


def _agreed_latest(root: str) -> Optional[str]:
    """``latest_dir`` as rank 0 sees it, on every rank (one broadcast when distributed)."""
    path = latest_dir(root) if _rank() == 0 else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [path]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
    return path


def resume(root: str, model, optimizer, data_seed: Optional[int] = None, *, stage: bool = False) -> int:
    """Load the newest complete checkpoint under ``root`` if there is one; returns the completed steps (0 if none)."""
    path = _agreed_latest(root)
    return 0 if path is None else load(path, model, optimizer, data_seed=data_seed, stage=stage)
