"""Foreach and fused-optimizer ops whose list entries are DTensors on different meshes.

An optimizer over a model with parameters on several meshes (torchtitan's MoE at EP > 1: the
dense parameters on the ``fsdp`` mesh, the experts on the ``(efsdp, ep)`` mesh) calls
``_fused_adamw_`` / ``_foreach_*`` once with all of them; so does ``clip_grads_with_norm_``.
Every such op is elementwise per list position, and torch's DTensor propagates a strategy per
list entry, each on its own mesh. Here the call is split instead: the list positions are grouped
by the mesh of their DTensors (first appearance order, the same on every rank), and the op runs
once per group with every list argument narrowed to that group's positions; out-of-place results
are put back in the original order. A call whose DTensors share one mesh is not touched.
"""
from __future__ import annotations


def _mesh_at(lists, position):
    """The mesh of the first DTensor at list position ``position`` (None when there is none)."""
    from hyper_parallel.dtensor.dtensor import DTensor
    for lst in lists:
        x = lst[position]
        if isinstance(x, DTensor):
            return x._mesh
    return None


def split_by_mesh(func, name, args, kwargs, dts):
    """Run a list op per mesh when its DTensors live on several meshes; ``NotImplemented`` otherwise."""
    if not (name.startswith("_foreach_") or name.startswith("_fused_")):
        return NotImplemented
    mesh = dts[0]._mesh
    if all(d._mesh is mesh for d in dts):
        return NotImplemented
    if all(d._mesh == mesh for d in dts):
        return NotImplemented
    pos_lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    if not pos_lists:
        return NotImplemented
    n = len(args[pos_lists[0]])
    pos_lists = [i for i in pos_lists if len(args[i]) == n]
    kw_lists = [k for k, v in (kwargs or {}).items() if isinstance(v, (list, tuple)) and len(v) == n]
    lists = [args[i] for i in pos_lists] + [kwargs[k] for k in kw_lists]
    groups, keys = {}, []
    for i in range(n):
        m = _mesh_at(lists, i)
        for k in keys:  # meshes compare by value: an equal mesh object joins the group
            if k is m or (k is not None and m is not None and k == m):
                groups[id(k)][1].append(i)
                break
        else:
            keys.append(m)
            groups[id(m)] = (m, [i])
    if len(groups) < 2:
        return NotImplemented
    out = [None] * n
    results = []
    for _, idx in groups.values():
        a = list(args)
        for p in pos_lists:
            a[p] = [args[p][i] for i in idx]
        kw = dict(kwargs or {})
        for k in kw_lists:
            kw[k] = [kwargs[k][i] for i in idx]
        r = func(*a, **kw)
        results.append((idx, r))
    if name.endswith("_") or all(r is None for _, r in results):
        return None  # in-place (as torch's foreach / fused in-place ops: they return None)
    if all(isinstance(r, (list, tuple)) and len(r) == len(idx) for idx, r in results):
        for idx, r in results:
            for i, x in zip(idx, r):
                out[i] = x
        return out
    raise NotImplementedError(f"{name}: DTensor list entries live on several meshes and the op's result "
                              f"({type(results[0][1]).__name__}) cannot be put back together per list position")


__all__ = ["split_by_mesh"]
