"""Layout-independent random numbers for DTensors.

Values are a pure function of (seed, call counter, global position): the
global tensor is cut into fixed blocks of rows along dim 0 (the block size
depends only on the global shape), each block drawn from a generator seeded
with ``(seed, counter, block)``. A rank draws just the blocks its shard
touches and slices them, so replicas agree, shards differ, and the gathered
tensor is the same for every mesh shape and placement.

Every rank must make the same sequence of random calls (SPMD), exactly as for
collectives. ``manual_seed`` resets the stream; otherwise the seed defaults to
``torch.initial_seed()`` read on first use.

**torch's scheme, for torch programs** (:func:`torch_manual_seed`, what a program run under
``hyper_parallel.swap`` gets for ``torch.distributed.tensor._random.manual_seed(seed, mesh)``):
torch 2.13 keeps no DTensor RNG tracker on a device without a settable generator (CPU:
``is_rng_supported_mesh`` is False, ``manual_seed`` warns and returns), so its random ops on
DTensors run the op on each rank's local shard with that rank's default generator. Once a torch
program has called it, random ops on non-Partial DTensors of such meshes do the same here
(:func:`draws_locally`), so ``nn.init`` on sharded parameters gives torch's values bit for bit.
On devices with a generator torch uses Philox offsets per shard (``OffsetBasedRNGTracker``),
which this module does not reproduce: the layout-independent stream is kept there.
``hyper_parallel.manual_seed`` (HyperParallel's entry point) returns to the stream.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, List, Optional, Sequence, Tuple
import warnings

from hyper_parallel.distributed import rng
import torch


_BLOCK_ELEMS = 1 << 16
_state = {"seed": None, "counter": 0, "scheme": "hyper_parallel"}
SCHEMES = ("hyper_parallel", "torch")
_SCHEME_HOOKS: list = []   # called when the scheme changes (the dispatcher's cached random-op strategies depend on it)


def on_scheme_change(callback: Callable[[], None]) -> None:
    if not callable(callback):
        raise TypeError(f"on_scheme_change: fn must be callable, got {callback!r}")
    _SCHEME_HOOKS.append(callback)


def _set(scheme):
    if _state["scheme"] != scheme:
        _state["scheme"] = scheme
        for h in _SCHEME_HOOKS:
            h()


def reset_seed_state() -> None:
    """Unseed the layout-independent stream (as in a fresh process); the scheme is kept."""
    _state["seed"] = None
    _state["counter"] = 0


def manual_seed(seed: int) -> None:
    """Seed the DTensor random stream (call with the same seed on every rank); HyperParallel's scheme."""
    if not isinstance(seed, int):
        raise TypeError(f"manual_seed: seed must be an int, got {seed!r}")
    _state["seed"] = seed
    _state["counter"] = 0
    _set("hyper_parallel")


def set_scheme(scheme: str) -> None:
    """``"hyper_parallel"`` (the layout-independent stream) or ``"torch"`` (torch 2.13's DTensor RNG where it
    is reproducible, see the module docstring)."""
    if scheme not in SCHEMES:
        raise ValueError(f"set_scheme: scheme must be one of {SCHEMES}, got {scheme!r}")
    _set(scheme)


def get_scheme() -> str:
    return str(_state["scheme"])


def device_has_rng(device_type: str) -> bool:
    """torch's ``is_rng_supported_mesh`` test: the device module can set its generator state (not CPU)."""
    handle = getattr(torch, str(device_type), None)
    return bool(handle is not None and hasattr(handle, "set_rng_state"))


def torch_manual_seed(seed: int, device_mesh: Any) -> None:
    """``torch.distributed.tensor._random.manual_seed(seed, device_mesh)`` with torch 2.13's behaviour.

    On a mesh whose device has no settable generator (CPU) torch only warns: it seeds nothing and
    its DTensor random ops draw each local shard from the rank's default generator. Here the same
    (torch's scheme from now on). Elsewhere torch seeds its default generator (``torch.manual_seed``);
    done too, and the shards keep the layout-independent stream, seeded with ``seed``
    (torch's per-shard Philox offsets are not reproduced).
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"manual_seed: seed must be an int, got {seed!r}")
    device_type = getattr(device_mesh, "device_type", "cpu")
    if not device_has_rng(device_type):
        warnings.warn(f"DTensor manual_seed() may not have complete support on {device_type} device mesh",
                      stacklevel=2)
        _set("torch")
        return
    if device_mesh.get_coordinate() is None:
        raise RuntimeError("manual_seed requires the current rank to be a part of the device mesh otherwise DTensor "
                           "RNG state on the rank will not be initialized and the behavior of DTensor random ops is "
                           "undefined.")
    torch.manual_seed(seed)
    manual_seed(seed)
    _set("torch")


def draws_locally(device_type: str, layouts: Sequence[Any]) -> bool:
    """Whether a random op on DTensors of ``layouts`` runs on each local shard with the rank's own generator:
    torch's scheme on a device without a DTensor RNG tracker, and no Partial input."""
    return (_state["scheme"] == "torch" and not device_has_rng(device_type)
            and not any(l.has_partial() for l in layouts))


def get_rng_state() -> dict:
    """The DTensor random stream's position: ``{"seed": seed or None (not drawn from yet), "offset": calls so far}``.

    Checkpoint it with the framework generators' states; :func:`set_rng_state` continues the
    stream from there (the same on every rank, and for every layout, like the stream itself).
    """
    return {"seed": _state["seed"], "offset": _state["counter"]}


def set_rng_state(state: dict) -> None:
    """Continue the DTensor random stream from ``get_rng_state()``'s ``{"seed", "offset"}`` (every rank alike)."""
    if not isinstance(state, dict) or set(state) != {"seed", "offset"}:
        raise ValueError(f"set_rng_state: state must be a dict with keys 'seed' and 'offset' (from get_rng_state()), "
                         f"got {state!r}")
    seed, offset = state["seed"], state["offset"]
    if (seed is not None and not isinstance(seed, int)) or isinstance(seed, bool):
        raise TypeError(f"set_rng_state: seed must be an int or None, got {seed!r}")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"set_rng_state: offset must be an int >= 0, got {offset!r}")
    _state["seed"] = seed
    _state["counter"] = offset


def _next_key():
    if _state["seed"] is None:
        _state["seed"] = torch.initial_seed()
    c = _state["counter"]
    _state["counter"] = c + 1
    return _state["seed"], c


def _block_seed(seed, counter, block):
    h = hashlib.blake2b(f"{seed}:{counter}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def random_local(kind: str, global_shape: Sequence[int], local_shape: Sequence[int], offset: Sequence[int],
                 dtype: Optional[torch.dtype] = None, device: Any = None) -> torch.Tensor:
    """This rank's piece (``local_shape`` at ``offset``) of a layout-independent random tensor."""
    seed, counter = _next_key()
    global_shape = tuple(global_shape)
    if not global_shape:
        return rng.seeded_random(kind, (), _block_seed(seed, counter, 0), dtype, device)
    row = 1
    for s in global_shape[1:]:
        row *= s
    rows_per_block = max(1, _BLOCK_ELEMS // max(row, 1))
    start, n = offset[0], local_shape[0]
    if n == 0 or any(s == 0 for s in local_shape):
        return torch.zeros(tuple(local_shape), dtype=dtype, device=device)
    b0, b1 = start // rows_per_block, (start + n - 1) // rows_per_block
    blocks = []
    for b in range(b0, b1 + 1):
        rows = min(rows_per_block, global_shape[0] - b * rows_per_block)
        blocks.append(rng.seeded_random(kind, (rows,) + global_shape[1:], _block_seed(seed, counter, b),
                                         dtype, device))
    full = blocks[0] if len(blocks) == 1 else torch.cat(blocks, 0)
    offs = (start - b0 * rows_per_block,) + tuple(offset[1:])
    return rng.narrow_block(full, offs, tuple(local_shape))


def consume_key() -> None:
    """Advance the stream by one call without drawing.

    A random op on DTensors held whole by every rank draws from the framework's own
    generator (torch's results); it still takes its place in the DTensor stream, so
    the draws of later ops on shards do not depend on whether earlier ones ran whole.
    """
    _next_key()


def random_rows(kind: str, n_rows: int, row_len: int, ranges: List[Tuple[int, int]],
                dtype: Optional[torch.dtype] = None, device: Any = None) -> torch.Tensor:
    """Rows ``ranges`` (a list of ``(start, stop)``) of a layout-independent ``(n_rows, row_len)`` random matrix.

    One call of the stream (one key), concatenated in the order of ``ranges``:
    ``random_rows(k, R, C, [(a, b)])`` equals ``random_local(k, (R, C), (b - a, C), (a, 0))``.
    Each block of rows is drawn once per call however many ranges touch it.
    """
    seed, counter = _next_key()
    ranges = [(int(a), int(b)) for a, b in ranges if b > a]
    total = sum(b - a for a, b in ranges)
    if total == 0 or row_len == 0:
        return torch.zeros((total, row_len), dtype=dtype, device=device)
    rows_per_block = max(1, _BLOCK_ELEMS // max(row_len, 1))
    cache: dict = {}
    pieces = []
    for a, b in ranges:
        if a < 0 or b > n_rows:
            raise ValueError(f"random_rows: row range ({a}, {b}) is outside the {n_rows} rows")
        r = a
        while r < b:
            blk = r // rows_per_block
            base = blk * rows_per_block
            t = cache.get(blk)
            if t is None:
                rows = min(rows_per_block, n_rows - base)
                t = cache[blk] = rng.seeded_random(kind, (rows, row_len), _block_seed(seed, counter, blk),
                                                    dtype, device)
            stop = min(b, base + rows_per_block)
            pieces.append(rng.narrow_block(t, (r - base, 0), (stop - r, row_len)))
            r = stop
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)


def is_rng_supported_mesh(device_mesh: Any = None) -> bool:
    """HyperParallel's / PyTorch's check before using DTensor random ops: always True here.

    The DTensor random stream is computed from (seed, call counter, global position),
    so it works on every device type, CPU included.
    """
    return True


__all__ = ["manual_seed", "set_scheme", "on_scheme_change", "get_scheme", "device_has_rng", "torch_manual_seed",
           "draws_locally", "get_rng_state", "set_rng_state", "random_local", "random_rows", "consume_key", "is_rng_supported_mesh"]
