"""Step checkpoints for the example trainer: DCP directories under one root plus a ``latest`` marker.

    DIR/step-000010/     one torch.distributed.checkpoint directory per saved step
    DIR/step-000020/
    DIR/latest           "step-000020", rewritten (atomically) only after that save completed

Why the marker: a save that dies part way (a killed rank, a full disk) leaves a
partial step directory behind, but ``latest`` still names the previous complete
one, so ``--resume`` never reads a torn checkpoint. ``dcp.save`` returns on every
rank only after rank 0 has written the directory's ``.metadata`` (its last act),
so the marker is written after that and a barrier.

State dicts come from :mod:`hyper_parallel.checkpoint` (keys are parameter FQNs),
so a checkpoint saved under one ``--dp/--tp`` layout resumes under any other, or
in one process.
"""
from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hyper_parallel.checkpoint import get_state_dict, load as checked_load, set_state_dict

LATEST = "latest"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def latest_dir(root: str) -> Optional[str]:
    """The step directory ``latest`` names, or None if there is no completed checkpoint under ``root``."""
    marker = os.path.join(root, LATEST)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        name = f.read().strip()
    path = os.path.join(root, name)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{marker} names {name!r}, but {path} does not exist")
    return path


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(root: str, step: int, model, optimizer) -> str:
    """Save model + optimizer after ``step`` completed steps (collective); returns the step directory."""
    path = step_dir(root, step)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": step, GROUPS: _groups_by_fqn(optim_sd)},
             checkpoint_id=path)
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


def load(path: str, model, optimizer, *, stage: bool = False) -> int:
    """Load a step directory into ``model``/``optimizer`` in their current layout; returns its step.

    ``stage=True`` (pipeline stages, ``--pp``): ``model`` holds only some of the checkpoint's parameters;
    the others are not read (every key of ``model`` must still be in the checkpoint)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": -1}
    if _has_groups_by_fqn(path):
        state[GROUPS] = _groups_by_fqn(optim_sd)
    if stage:  # shapes checked first; a key missing from the checkpoint fails DCP's planning on every rank
        checked_load(state, checkpoint_id=path, strict=False, planner=dcp.DefaultLoadPlanner(allow_partial_load=False))
    else:
        checked_load(state, checkpoint_id=path)  # keys and shapes checked on every rank first
    if GROUPS in state:  # --- pipeline stages: each rank's param_groups name only its stages' parameters
        optim_sd["param_groups"] = [{**hyper, "params": [fqn]} for fqn, hyper in state[GROUPS].items()]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
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


def resume(root: str, model, optimizer, *, stage: bool = False) -> int:
    """Load ``latest`` under ``root`` if there is one; returns the number of completed steps (0 if none)."""
    path = latest_dir(root)
    return 0 if path is None else load(path, model, optimizer, stage=stage)
