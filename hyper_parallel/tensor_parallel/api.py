"""parallelize_module: apply a plan of parallel styles to a module tree."""
from __future__ import annotations

import fnmatch
import warnings
from typing import Dict, Optional, Union

from torch import nn

from hyper_parallel.dtensor.device_mesh import DeviceMesh, resolve_mesh
from hyper_parallel.tensor_parallel.style import ParallelStyle, _module_path


def parallelize_module(module: nn.Module, device_mesh: Optional[DeviceMesh] = None,
                       parallelize_plan: Union[ParallelStyle, Dict[str, ParallelStyle], None] = None, *,
                       src_data_rank: Optional[int] = 0) -> nn.Module:
    """Shard ``module`` in place following ``parallelize_plan`` and return it.

    Args:
        module: the module to parallelize.
        device_mesh: a 1-D mesh (slice a multi-dimensional mesh first, e.g. ``mesh["tp"]``; styles
            whose ``accepts_nd_mesh`` is True, such as ``ExpertTensorParallel``, take more dims);
            defaults to the current mesh (``with mesh:``).
        parallelize_plan: a :class:`ParallelStyle` for ``module`` itself, or a dict from
            fully-qualified submodule names to styles (or to nested plans); names may use
            ``fnmatch`` wildcards per path component (``"layers.*.attention.wq"``).
        src_data_rank: the rank whose parameter values are scattered (``None``: every rank
            slices its own copy with no communication).

    As in PyTorch: no plan (``None``) warns and does nothing; the key ``""`` names
    ``module`` itself; a plan entry that matches no submodule warns and is skipped.

    Raises:
        ValueError: for a multi-dimensional mesh.
        TypeError: for a plan that is not a style or a dict of them.
        NotImplementedError: from a style applied to a module type it does not support; the
            message names the module's fully qualified path.
    """
    if parallelize_plan is None:
        warnings.warn("No parallelize_plan is provided and auto-parallel is not supported at the moment, so this "
                      "parallelize_module call will do nothing.", UserWarning, stacklevel=2)
        return module
    mesh = resolve_mesh(device_mesh, "parallelize_module")
    if mesh.ndim != 1 and not _accepts_nd_mesh(parallelize_plan):
        raise ValueError(f"parallelize_module: device_mesh must be 1-D, got a {mesh.ndim}-D mesh {mesh}; slice it "
                         f"first, e.g. mesh['{(mesh.mesh_dim_names or ('tp',))[-1]}']")
    if src_data_rank is not None and (not isinstance(src_data_rank, int) or isinstance(src_data_rank, bool)):
        raise TypeError(f"parallelize_module: src_data_rank must be an int rank or None, got {src_data_rank!r}")
    return _parallelize(module, mesh, parallelize_plan, src_data_rank, "")


def _accepts_nd_mesh(plan) -> bool:
    """A plan whose every style declares ``accepts_nd_mesh`` (``ContextParallel``: hybrid on a 2-D cp mesh;
    ``ExpertTensorParallel``: its ("ep", "tp") mesh)."""
    if isinstance(plan, dict):
        return bool(plan) and all(_accepts_nd_mesh(p) for p in plan.values())
    return bool(getattr(plan, "accepts_nd_mesh", False))


def _parallelize(module, mesh, plan, src_data_rank, prefix: str):
    """Apply ``plan`` to ``module``, whose fully qualified name in the root module is ``prefix``."""
    if plan is None:
        return module
    if isinstance(plan, ParallelStyle):
        plan.src_data_rank = src_data_rank
        with _module_path(prefix):
            return plan.apply(module, mesh)
    if not isinstance(plan, dict):
        at = f" for {prefix!r}" if prefix else ""
        raise TypeError(f"parallelize_module: parallelize_plan{at} must be a ParallelStyle or a dict of them, "
                        f"got {type(plan).__name__}")
    for fqn, style in plan.items():
        if not isinstance(fqn, str):
            raise TypeError(f"parallelize_module: plan keys must be module names (str), got {fqn!r}")
        full = (f"{prefix}.{fqn}" if fqn else prefix) if prefix else fqn
        if not isinstance(style, (ParallelStyle, dict)):
            raise TypeError(f"parallelize_module: plan entry {full!r} must be a ParallelStyle (or a nested plan "
                            f"dict), got {style!r}")
        if fqn == "":  # the module itself
            _parallelize(module, mesh, style, src_data_rank, prefix)
            continue
        matched = _apply_path(module, fqn.split("."), style, mesh, src_data_rank, prefix)
        if not matched:
            names = [n for n, _ in module.named_modules() if n][:20]
            token = _unresolved_token(module, fqn.split("."))
            warnings.warn(f"Parallelize plan key {full!r} could not be resolved: no submodule matching token "
                          f"{token!r} in module {type(module).__name__}, skipping this plan entry (plan entry "
                          f"{full!r} matches no submodule; submodules include {names})", UserWarning, stacklevel=3)
    return module


def _apply_path(module, atoms, style, mesh, src_data_rank, prefix) -> int:
    head, rest = atoms[0], atoms[1:]
    n = 0
    for name, child in module.named_children():
        if fnmatch.fnmatch(name, head):
            path = f"{prefix}.{name}" if prefix else name
            if rest:
                n += _apply_path(child, rest, style, mesh, src_data_rank, path)
            else:
                _parallelize(child, mesh, style, src_data_rank, path)
                n += 1
    return n


def _unresolved_token(module, atoms) -> str:
    """The first path component of a plan key that no submodule matches (for the warning)."""
    level = [module]
    for atom in atoms:
        level = [c for m in level for name, c in m.named_children() if fnmatch.fnmatch(name, atom)]
        if not level:
            return atom
    return atoms[-1]
