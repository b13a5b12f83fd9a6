"""Sibling slices of one root ``torch.distributed`` mesh, seen as dims of one hyper_parallel mesh.

torch 2.13 builds N-D meshes by unflattening a world mesh (``world._unflatten(0, (dp, tp), ("dp",
"tp"))``) and slicing them; the slices (``mesh["fsdp"]``, ``mesh["tp"]``, also from different
unflattenings of the same world mesh) are views with their own layout over the root's rank map.
hyper_parallel adopts each torch mesh on its own (``adopt_foreign_mesh``), so two slices do not know
they are dims of one grid. :func:`unify_roots` gives them a common root: the hyper_parallel mesh
whose dims are the slices' dims ordered outer (largest stride) first, with the slices' own process
groups, and re-points each adopted slice's ``_root`` / ``_root_dims`` to it. ``fully_shard`` on a
dp slice of parameters that are DTensors on a TP slice then composes the two layouts as for slices
of one hyper_parallel mesh. Slices whose dims overlap or that do not form a grid raise.

Only torch's layout objects are read (``_layout``, ``_rank_map``, ``_get_root_mesh``); no collective
runs (the groups exist already).
"""
from __future__ import annotations

_COMBINED = {}  # (torch root's rank map, ranks, dim names) -> combined hyper_parallel mesh


def describe_torch_slice(tmesh):
    """``(root mesh, [(offsets, outer stride)] per dim, coordinate)`` of a torch mesh, or None.

    Taken when the mesh is adopted: slices are often temporaries (``mesh["tp"]``) that are gone when
    ``fully_shard`` later meets a DTensor on them.
    """
    if not hasattr(tmesh, "_layout") or not hasattr(tmesh, "_get_root_mesh"):
        return None
    try:
        return tmesh._get_root_mesh(), _dims(tmesh), tmesh.get_coordinate()
    except Exception:  # a layout this module does not understand: no sibling combination
        return None


def _nest(flat, shape):
    """``flat`` as nested lists of ``shape`` (row-major)."""
    if len(shape) == 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def _ints(values):
    if isinstance(values, (tuple, list)):
        return [v for item in values for v in _ints(item)]
    return [int(values)]


def _dims(tmesh):
    """[(offsets of the dim's coordinates over the root rank map, outer stride)] for each dim of a torch mesh."""
    out = []
    for d in range(tmesh.ndim):
        flat = tmesh._layout[d]
        offs = [int(o) for o in flat.all_ranks_from_zero()]
        stride = max(_ints(flat.stride), default=1)
        out.append((tuple(offs), stride))
    return out


def unify_roots(first, second) -> bool:
    """Give hyper_parallel meshes ``first`` and ``second`` (adopted slices of one torch root mesh) a common root.

    Returns True when they share a root afterwards (already or now); False when they are not
    adopted torch slices of one root (the caller's own checks then apply).
    """
    if first._root is second._root:
        return True
    fa, fb = getattr(first, "_foreign", None), getattr(second, "_foreign", None)
    if fa is None or fb is None:
        return False
    (root, da, ca), (root_b, db, cb) = fa, fb
    # torch meshes compare by layout, rank map and names; an adopted mesh may come from an equal
    # torch mesh built earlier (the adoption cache), whose root is an equal but other object
    if ca is None or cb is None or not (root_b is root or root_b == root):
        return False
    all_dims = [("a", i, offs, st) for i, (offs, st) in enumerate(da)] + \
               [("b", i, offs, st) for i, (offs, st) in enumerate(db)]
    # outer (largest stride) first, as torch orders an unflattened mesh
    order = sorted(range(len(all_dims)), key=lambda k: -all_dims[k][3])
    rank_map = [int(r) for r in root._rank_map.tolist()]
    me = first._rank
    idx_me = rank_map.index(me)
    coord = {("a", i): c for i, c in enumerate(ca)}
    coord.update({("b", i): c for i, c in enumerate(cb)})
    base = idx_me - sum(all_dims[k][2][coord[(all_dims[k][0], all_dims[k][1])]] for k in order)
    sizes = [len(all_dims[k][2]) for k in order]
    # every point of the grid, row-major over `order`
    ranks, seen = [], set()
    total = 1
    for s in sizes:
        total *= s
    for flat in range(total):
        rem, cs = flat, []
        for s in reversed(sizes):
            cs.append(rem % s)
            rem //= s
        cs.reverse()
        idx = base + sum(all_dims[k][2][c] for k, c in zip(order, cs))
        if not 0 <= idx < len(rank_map) or idx in seen:
            raise ValueError(f"meshes {first} and {second} are slices of one torch mesh whose mesh dims overlap; they "
                             "cannot be combined (fully_shard needs the dp and the TP mesh dims to be different mesh dims "
                             "of one mesh)")
        seen.add(idx)
        ranks.append(rank_map[idx])
    names = []
    for k in order:
        which, i = all_dims[k][0], all_dims[k][1]
        m = first if which == "a" else second
        names.append(m.mesh_dim_names[i] if m.mesh_dim_names else f"{which}{i}")
    if len(set(names)) != len(names):
        raise ValueError(f"meshes {first} and {second} share a mesh dim name ({names}); they cannot be combined")
    key = (tuple(rank_map), tuple(ranks), tuple(names))
    combined = _COMBINED.get(key)
    if combined is None:
        combined = type(first)(first.device_type, _nest(ranks, sizes), mesh_dim_names=tuple(names), _init_groups=False)
        for pos, k in enumerate(order):
            which, i = all_dims[k][0], all_dims[k][1]
            combined._groups[pos] = (first if which == "a" else second)._groups[i]
        _COMBINED[key] = combined
    first._root, first._root_dims = combined, tuple(order.index(k) for k in range(len(da)))
    second._root, second._root_dims = combined, tuple(order.index(len(da) + k) for k in range(len(db)))
    return True


__all__ = ["unify_roots"]
