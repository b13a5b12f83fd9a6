"""parallelize_module: apply a plan of parallel styles to a module tree."""
from __future__ import annotations

import fnmatch
from typing import Dict, Optional, Union

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, resolve_mesh
from hyper_parallel.core.tensor_parallel.style import ParallelStyle


def parallelize_module(module, device_mesh: Optional[DeviceMesh] = None,
                       parallelize_plan: Union[ParallelStyle, Dict[str, ParallelStyle], None] = None, *,
                       src_data_rank: Optional[int] = 0):
    """Shard ``module`` in place following ``parallelize_plan`` and return it.

    Args:
        module: the module to parallelize.
        device_mesh: a 1-D mesh (slice a multi-dimensional mesh first, e.g. ``mesh["tp"]``);
            defaults to the current mesh (``with mesh:``).
        parallelize_plan: a :class:`ParallelStyle` for ``module`` itself, or a dict from
            fully-qualified submodule names to styles; names may use ``fnmatch``
            wildcards per path component (``"layers.*.attention.wq"``).
        src_data_rank: the rank whose parameter values are scattered (``None``: every rank
            slices its own copy with no communication).

    Raises:
        ValueError: for a multi-dimensional mesh, or a plan entry that matches no submodule.
    """
    mesh = resolve_mesh(device_mesh, "parallelize_module")
    if mesh.ndim != 1:
        raise ValueError(f"parallelize_module: device_mesh must be 1-D, got a {mesh.ndim}-D mesh {mesh}; slice it "
                         f"first, e.g. mesh['{(mesh.mesh_dim_names or ('tp',))[-1]}']")
    if parallelize_plan is None:
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan.src_data_rank = src_data_rank
        return parallelize_plan.apply(module, mesh)
    if not isinstance(parallelize_plan, dict):
        raise TypeError(f"parallelize_module: parallelize_plan must be a ParallelStyle or a dict of them, "
                        f"got {type(parallelize_plan).__name__}")
    for fqn, style in parallelize_plan.items():
        if not isinstance(style, (ParallelStyle, dict)):
            raise TypeError(f"parallelize_module: plan entry {fqn!r} must be a ParallelStyle, got {style!r}")
        matched = _apply_path(module, fqn.split("."), style, mesh, src_data_rank)
        if not matched:
            names = [n for n, _ in module.named_modules() if n][:20]
            raise ValueError(f"parallelize_module: plan entry {fqn!r} matches no submodule of "
                             f"{type(module).__name__} (submodules include {names})")
    return module


def _apply_path(module, atoms, style, mesh, src_data_rank) -> int:
    head, rest = atoms[0], atoms[1:]
    n = 0
    for name, child in module.named_children():
        if fnmatch.fnmatch(name, head):
            if rest:
                n += _apply_path(child, rest, style, mesh, src_data_rank)
            else:
                parallelize_module(child, mesh, style, src_data_rank=src_data_rank)
                n += 1
    return n
