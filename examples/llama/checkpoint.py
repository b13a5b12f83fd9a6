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
    dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=path)
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


def load(path: str, model, optimizer) -> int:
    """Load a step directory into ``model``/``optimizer`` in their current layout; returns its step."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": -1}
    checked_load(state, checkpoint_id=path)  # keys and shapes checked on every rank first
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def resume(root: str, model, optimizer) -> int:
    """Load ``latest`` under ``root`` if there is one; returns the number of completed steps (0 if none)."""
    path = latest_dir(root)
    return 0 if path is None else load(path, model, optimizer)
