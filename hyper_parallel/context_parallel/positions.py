"""This rank's global sequence positions under context parallelism, for models that compute their own positions.

A model that builds its position ids itself (Hugging Face: ``arange(local sequence length)`` inside the
model, then a rotary module turns them into cos/sin) would give every cp rank positions ``0 .. S/cp``:
silently wrong. :func:`rank_positions` reads the order the last shard helper recorded for the cp group
(:mod:`.order`: ``cp_shard``, ``Plan.shard_batch``, torch's ``_context_parallel_shard``) and returns the
global position of every local row; :func:`true_position_ids` maps a model's default position ids onto
them and refuses anything it cannot place. Where no recorded order fits the local length it raises,
naming the module and the fix: it never guesses.
"""
from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.context_parallel.api import _flat_index
from hyper_parallel.context_parallel.order import group_key, recorded
from hyper_parallel.context_parallel.plan import positions
from hyper_parallel.dtensor.device_mesh import resolve_mesh


def rank_positions(mesh: Any, local_len: int, what: str = "context parallelism") -> torch.Tensor:
    """``[rows, local_len]`` int64: the global position of each of this rank's ``local_len`` sequence rows
    (one row, or one per batch row when the recorded order differs along the batch)."""
    mesh = resolve_mesh(mesh, what)
    order = recorded(group_key(mesh))
    f = _flat_index(mesh)
    if order is None or order.local_len(f) != local_len:
        found = "no sequence order is recorded for it" if order is None else \
            f"the recorded order {order!r} gives this rank {order.local_len(f)} rows"
        raise RuntimeError(
            f"{what}: this rank (cp index {f} of {mesh.size()}) holds {local_len} sequence rows, but {found}; the "
            "global positions of the rows are unknown, so the positions would be wrong. Shard every batch with "
            "plan.shard_batch(x, y) (or hyper_parallel.context_parallel.cp_shard(cp_mesh, [x, y], [1, 1])) before "
            "the forward")
    rows = [positions(layout[f]) for layout in order.layouts()]
    return torch.tensor(rows, dtype=torch.long)


def true_position_ids(position_ids: torch.Tensor, mesh: Any, local_len: int, what: str) -> torch.Tensor:
    """The position ids a model should use on this rank: its default ``offset + arange(n)`` (n = the rows it
    sees, ``local_len`` the rows of the attention's sequence shard, larger with sequence parallelism) becomes
    ``offset +`` the rank's global positions; ids already equal to those are kept. Anything else raises."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2):
        raise TypeError(f"{what}: expected position ids of shape [seq] or [batch, seq], got "
                        f"{type(position_ids).__name__} {tuple(getattr(position_ids, 'shape', ()))}")
    ids = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
    true = rank_positions(mesh, local_len, what).to(ids.device)
    if ids.shape[-1] == local_len and true.shape[0] in (1, ids.shape[0]) and torch.equal(
            ids, true.expand(ids.shape[0], -1).to(ids.dtype)):
        return position_ids
    offset = ids[:, :1]
    arange = torch.arange(ids.shape[-1], device=ids.device, dtype=ids.dtype)
    if not torch.equal(ids, offset + arange):
        raise ValueError(
            f"{what}: under context parallelism the position ids must be the model's default (offset + arange of the "
            f"local length) or this rank's global positions; got {ids[0, :16].tolist()}"
            f"{'...' if ids.shape[-1] > 16 else ''}. Pass no position_ids (the library maps them to each rank's "
            "positions) or cp_shard the global position ids with the same load_balance as the inputs")
    if not (offset.shape[0] == 1 or true.shape[0] in (1, offset.shape[0])):
        raise ValueError(f"{what}: the recorded sequence order has {true.shape[0]} batch rows but the position ids "
                         f"have {ids.shape[0]}")
    out = offset + true.to(ids.dtype)
    return out if position_ids.dim() == 2 else out[0]


def hook_position_ids(module: torch.nn.Module, mesh: Any, *, name: str = "position_ids", index: int = 1) -> Any:
    """Make ``module`` (e.g. a Hugging Face rotary embedding, ``forward(x, position_ids)``) see this rank's global
    positions under context parallelism: a forward pre-hook maps its ``name`` argument (keyword, or positional
    ``index``) with :func:`true_position_ids`. For models parallelized by hand (``Plan.apply`` does it itself).
    Returns the hook handle."""
    what = f"{type(module).__name__} (hook_position_ids)"

    def pre(mod, args, kwargs):
        if name in kwargs:
            kwargs = dict(kwargs)
            kwargs[name] = true_position_ids(kwargs[name], mesh, kwargs[name].shape[-1], what)
            return args, kwargs
        if len(args) <= index:
            raise TypeError(f"{what}: called without {name!r} (expected it as keyword or positional input {index})")
        args = list(args)
        args[index] = true_position_ids(args[index], mesh, args[index].shape[-1], what)
        return tuple(args), kwargs

    return module.register_forward_pre_hook(pre, with_kwargs=True)


__all__ = ["rank_positions", "true_position_ids", "hook_position_ids"]
