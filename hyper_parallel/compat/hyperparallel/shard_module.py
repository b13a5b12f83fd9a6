"""shard_module: HyperParallel's declarative sharding, built on distribute_module.

``shard_module(model, device_mesh, ShardingPlan(plan=..., input_plan=...,
output_plan=..., return_local_tensor=...))``:

* parameters named in ``plan`` become DTensors with the given layout
  (``distribute_tensor`` of the full parameter); every other parameter and
  buffer is replicated, as :func:`distribute_module` does, so the module runs
  entirely on DTensors and its gradients are single-program (PyTorch) ones;
* ``input_plan`` / ``output_plan`` entries become forward pre-hooks / forward
  hooks on the named (sub)module that redistribute DTensor arguments / outputs
  to the given layouts (plain tensors pass through, as in HyperParallel);
* ``return_local_tensor`` modules hand back ``to_local()`` of their DTensor
  outputs (differentiable).

A plan key that names no parameter or submodule raises ``ValueError`` before
anything is changed. ``model`` may also be a plain function: then only
``input_plan["input"]`` and ``output_plan["output"]`` apply.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List

from hyper_parallel.dtensor.device_mesh import DeviceMesh, resolve_mesh
from hyper_parallel.dtensor.dtensor import DTensor, build_layout
from hyper_parallel.dtensor.api import distribute_module, distribute_tensor
from hyper_parallel.dtensor.layout import Layout
from hyper_parallel.dtensor.layout_hp_methods import PlacementSpec
from hyper_parallel.dtensor.placement_types import Placement, Replicate
from hyper_parallel.compat.hyperparallel.sharding_plan import ShardingPlan
import torch


_SUFFIXES = ("input", "output")


# ----------------------------------------------------------------------------- specs
def _is_spec(value) -> bool:
    """One layout: a Layout, or a tuple/list of placements / alias names (a name tuple = multi-axis shard)."""
    if isinstance(value, (Layout, PlacementSpec)):
        return True
    if not isinstance(value, (tuple, list)) or not value:
        return False
    for item in value:
        if isinstance(item, (Placement, str)):
            continue
        if isinstance(item, tuple) and item and all(isinstance(x, str) for x in item):
            continue
        return False
    return True


def _to_layout(spec, mesh: DeviceMesh, ndim: int, what: str) -> Layout:
    """The layout of an ``ndim``-d tensor on ``mesh`` described by ``spec``."""
    if isinstance(spec, Layout):
        if spec.dim_map is None:
            raise ValueError(f"{what}: the Layout {spec!r} describes only the device matrix; call it with one alias "
                             "per tensor dim first, e.g. layout('dp', 'None')")
        if tuple(spec.mesh_shape) != tuple(mesh.shape):
            raise ValueError(f"{what}: the Layout's mesh_shape {spec.mesh_shape} differs from the device_mesh shape "
                             f"{mesh.shape}")
        if spec.ndim != ndim:
            raise ValueError(f"{what}: the Layout describes a {spec.ndim}-d tensor but the tensor has {ndim} dims")
        base = build_layout(mesh, [Replicate()] * mesh.ndim, ndim, what)
        return base.with_dim_map(spec.dim_map, spec.partial)
    return build_layout(mesh, tuple(spec), ndim, what)


def _normalize_io(value, what: str):
    """An input/output plan value as a list (one spec per position) or a dict (by argument name)."""
    if value is None:
        return None
    if isinstance(value, dict):
        return dict(value)
    if _is_spec(value):
        return [value]
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if v is not None and not _is_spec(v):
                raise TypeError(f"{what}[{i}] = {v!r} is not a layout (placements, alias names or a Layout) or None")
        return list(value)
    raise TypeError(f"{what} = {value!r}: expected placements, alias names, a Layout, a list of them (one per "
                    "positional argument / output) or a dict keyed by argument name")


def _redistribute(value, spec, mesh, what):
    if spec is None or not isinstance(value, DTensor):
        return value
    return value.redistribute(mesh, _to_layout(spec, mesh, value.ndim, what))


# ----------------------------------------------------------------------------- hooks
def _arg_names(func) -> List[str]:
    try:
        return [p.name for p in inspect.signature(func).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return []


def _apply_inputs(specs, names, args, kwargs, mesh, what):
    args = list(args)
    if isinstance(specs, dict):
        for i, a in enumerate(args):
            if i < len(names) and names[i] in specs:
                args[i] = _redistribute(a, specs[names[i]], mesh, f"{what}[{names[i]!r}]")
        kwargs = {k: _redistribute(v, specs.get(k), mesh, f"{what}[{k!r}]") for k, v in kwargs.items()}
    else:
        for i, a in enumerate(args[:len(specs)]):
            args[i] = _redistribute(a, specs[i], mesh, f"{what}[{i}]")
    return tuple(args), kwargs


def _apply_outputs(specs, out, mesh, what):
    if isinstance(specs, dict):
        raise TypeError(f"{what}: an output plan must be one layout or a list of them, not a dict")
    if isinstance(out, (tuple, list)):
        if len(out) != len(specs):
            raise ValueError(f"{what}: the module returned {len(out)} outputs but the plan gives {len(specs)} "
                             "layouts")
        res = [_redistribute(o, s, mesh, f"{what}[{i}]") for i, (o, s) in enumerate(zip(out, specs))]
        return type(out)(res) if type(out) in (tuple, list) else tuple(res)
    if len(specs) != 1:
        raise ValueError(f"{what}: the module returned one output but the plan gives {len(specs)} layouts")
    return _redistribute(out, specs[0], mesh, what)


def _to_local(out):
    if isinstance(out, DTensor):
        return out.to_local()
    if isinstance(out, (tuple, list)):
        res = [_to_local(o) for o in out]
        return type(out)(res) if type(out) in (tuple, list) else tuple(res)
    return out


def _split_key(key: str, what: str):
    prefix, _, suffix = key.rpartition(".")
    if suffix not in _SUFFIXES:
        raise ValueError(f"{what}: key {key!r} must be 'input'/'output' or end with '.input'/'.output' "
                         "(the path of a submodule)")
    return prefix, suffix


# ----------------------------------------------------------------------------- entry point
def shard_module(model, device_mesh: DeviceMesh, sharding_plan: ShardingPlan):
    """Shard ``model``'s parameters, inputs and outputs as ``sharding_plan`` says (see the module docstring).

    Returns ``model`` (changed in place) or, for a plain function, the wrapped function.
    """
    if not isinstance(sharding_plan, ShardingPlan):
        raise TypeError(f"shard_module: sharding_plan must be a ShardingPlan, got {type(sharding_plan).__name__} "
                        "(wrap a dict as ShardingPlan(plan=...))")
    mesh = resolve_mesh(device_mesh, "shard_module")
    for field in ("plan", "input_plan", "output_plan"):
        v = getattr(sharding_plan, field)
        if v is not None and not isinstance(v, dict):
            raise TypeError(f"shard_module: ShardingPlan.{field} must be a dict, got {type(v).__name__}")
    io = {}
    for field in ("input_plan", "output_plan"):
        for key, value in (getattr(sharding_plan, field) or {}).items():
            prefix, suffix = _split_key(key, f"ShardingPlan.{field}")
            io[(prefix, suffix)] = (_normalize_io(value, f"ShardingPlan.{field}[{key!r}]"), key)
    if not isinstance(model, torch.nn.Module):
        if not callable(model):
            raise TypeError(f"shard_module: model must be a Module or a callable, got {type(model).__name__}")
        return _shard_callable(model, mesh, sharding_plan, io)

    params = dict(model.named_parameters())
    plan = dict(sharding_plan.plan or {})
    for key in plan:
        if key not in params:
            known = ", ".join(list(params)[:12]) + (", ..." if len(params) > 12 else "")
            raise ValueError(f"shard_module: ShardingPlan.plan key {key!r} matches no parameter of "
                             f"{type(model).__name__}; its parameters are: {known or '(none)'}")
    modules = dict(model.named_modules())
    for (prefix, suffix), (_, key) in io.items():
        if prefix not in modules:
            raise ValueError(f"shard_module: plan key {key!r} names submodule {prefix!r}, which {type(model).__name__} "
                             "does not have")
    local_names = list(sharding_plan.return_local_tensor or [])
    for name in local_names:
        if name not in modules:
            raise ValueError(f"shard_module: ShardingPlan.return_local_tensor entry {name!r} matches no submodule of "
                             f"{type(model).__name__}")
    # resolve every parameter layout first: a bad one raises before the model changes
    layouts = {key: _to_layout(spec, mesh, params[key].dim(), f"ShardingPlan.plan[{key!r}]")
               for key, spec in plan.items()}

    def partition_fn(name, sub, mesh_):
        for pname, p in list(sub._parameters.items()):
            full = f"{name}.{pname}" if name else pname
            lay = layouts.get(full)
            if p is None or lay is None or isinstance(p, DTensor):
                continue
            dt = distribute_tensor(p.detach(), mesh_, lay)
            sub.register_parameter(pname, torch.nn.Parameter(dt, requires_grad=p.requires_grad))

    distribute_module(model, mesh, partition_fn)
    for (prefix, suffix), (specs, key) in io.items():
        mod = modules[prefix]
        if specs is None:
            continue
        if suffix == "input":
            names = _arg_names(mod.forward)
            mod.register_forward_pre_hook(
                functools.partial(_input_hook, specs, names, mesh, f"input_plan[{key!r}]"), with_kwargs=True)
        else:
            mod.register_forward_hook(functools.partial(_output_hook, specs, mesh, f"output_plan[{key!r}]"))
    for name in local_names:
        modules[name].register_forward_hook(_local_hook)
    return model


def _input_hook(specs, names, mesh, what, module, args, kwargs):
    return _apply_inputs(specs, names, args, kwargs, mesh, what)


def _output_hook(specs, mesh, what, module, args, out):
    return _apply_outputs(specs, out, mesh, what)


def _local_hook(module, args, out):
    return _to_local(out)


def _shard_callable(func: Callable, mesh, sharding_plan: ShardingPlan, io_plans: Dict[Any, Any]):
    extra = [key for (prefix, _), (_, key) in io_plans.items() if prefix]
    if sharding_plan.plan or sharding_plan.return_local_tensor or extra:
        raise ValueError("shard_module: a plain function has no parameters or submodules; only "
                         f"input_plan['input'] and output_plan['output'] apply (got {extra or 'plan entries'})")
    ins = io_plans.get(("", "input"), (None, None))[0]
    outs = io_plans.get(("", "output"), (None, None))[0]
    names = _arg_names(func)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if ins is not None:
            args, kwargs = _apply_inputs(ins, names, args, kwargs, mesh, "input_plan['input']")
        out = func(*args, **kwargs)
        return _apply_outputs(outs, out, mesh, "output_plan['output']") if outs is not None else out
    return wrapper


__all__ = ["shard_module", "ShardingPlan"]
