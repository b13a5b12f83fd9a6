"""Placement lists longer than the mesh, HyperParallel's way (docs/migrating_from_hyperparallel.md).

HyperParallel pairs placements with mesh dims and ignores the entries past the mesh's last dim,
whatever they are. On a mesh that follows HyperParallel's semantics, ``distribute_tensor``,
``from_local``, ``redistribute``, the factories and ``build_layout`` all do the same, with one warning
per distinct list naming the ignored entries: they call ``semantics_of(mesh).trim_placements``, which
is :func:`drop_extra_placements` for HyperParallel's meshes (``semantics.py``). On PyTorch's meshes
nothing changes: ``distribute_tensor`` wants exactly one placement per mesh dim, the others drop extra
trailing ``Replicate()`` entries and raise for an extra ``Shard``/``Partial``.
"""
from __future__ import annotations

import warnings

_WARNED: set = set()


def drop_extra_placements(mesh, placements, what: str = "placements", stacklevel: int = 3):
    """``placements`` cut to ``mesh.ndim`` entries (warning once), for a mesh with HyperParallel's semantics.

    Only placement-object lists are touched (alias names are one per tensor dim).
    """
    if not isinstance(placements, (list, tuple)):
        return placements
    n = mesh.ndim
    if len(placements) <= n:
        return placements
    if any(isinstance(p, str) or (isinstance(p, tuple) and p and isinstance(p[0], str)) for p in placements):
        return placements  # alias spelling (or a mix, which build_layout rejects with its own message)
    kept, extra = tuple(placements[:n]), tuple(placements[n:])
    key = (tuple(placements), n)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"{what}: {tuple(placements)} has {len(placements)} entries for a {n}-d mesh; as in "
                      f"HyperParallel the entries past the mesh's last dim are ignored: {extra} (placements[{n}:]); "
                      f"using {kept}", UserWarning, stacklevel=stacklevel)
    return kept


__all__ = ["drop_extra_placements"]
