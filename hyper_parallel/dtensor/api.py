"""Creating DTensors: distribute_tensor, distribute_module and factory functions."""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch.nn as nn

from hyper_parallel.dtensor.device_mesh import DeviceMesh, resolve_mesh
from hyper_parallel.dtensor.mesh_semantics import semantics_of
from hyper_parallel.dtensor.dtensor import DTensor, _check_strided_label, _off_mesh_local, build_layout
from hyper_parallel.dtensor.hp_module_names import provide_dtensor_names
from hyper_parallel.dtensor.layout import Layout, is_alias_spelling
from hyper_parallel.dtensor.placement_types import Replicate
from hyper_parallel.dtensor import random as dt_random
from hyper_parallel.dtensor import redistribute_plan as rp
from hyper_parallel.dtensor.redistribute import run_plan
from hyper_parallel.dtensor.strided_local import slice_strided
from hyper_parallel.distributed import collectives
from hyper_parallel.distributed import deferred_grads
from hyper_parallel.distributed import groups
from hyper_parallel.distributed import rng
import torch

_mark_leaf = deferred_grads.mark_dtensor_leaf  # its partial gradients may stay Partial


def _slice_local(tensor, layout, mesh, gshape):
    if layout.is_strided:  # pieces that are not one box (a residual _StridedShard)
        return slice_strided(tensor, layout, mesh.get_coordinate())
    shape, offset = layout.local_shape_and_offset(gshape, coord=mesh.get_coordinate())
    return rng.narrow_block(tensor, offset, shape)


def _chunk_sizes(length: int, pieces: int):
    """Extents of ``torch.chunk(x, pieces)`` pieces of a ``length``-long dim, padded with zeros to ``pieces``
    entries."""
    c = -(-length // pieces) if length else 0
    return [max(0, min(c, length - i * c)) for i in range(pieces)]


def _scatter_from(tensor, mesh: DeviceMesh, layout, src_data_rank: int):
    """This rank's piece of the tensor held by mesh coordinate ``(src,)*ndim``, as PyTorch sends it.

    Mesh dims in order: a Shard dim scatters the pieces from the line's source
    rank (each rank receives only its piece), a Replicate dim broadcasts. Returns
    None for a layout that placements in mesh order cannot express (alias layouts
    sharding one tensor dim in another order): the caller broadcasts and slices.
    """
    placements = layout.placements
    if not layout.is_mesh_ordered or layout.is_strided or build_layout(mesh, placements, tensor.dim()) != layout:
        return None
    out = tensor.detach().contiguous()
    for d, p in enumerate(placements):
        k = mesh.size(d)
        if k == 1:
            continue
        group = mesh.get_comm_group(d)
        src = group.ranks[src_data_rank]
        if p.is_shard():
            out = collectives.split_scatter(out, p.dim, group, src, _chunk_sizes(out.shape[p.dim], k))
        else:
            out = collectives.broadcast(out, group, src)
    return out


def _broadcast_from(tensor, mesh: DeviceMesh, src_data_rank: int):
    """Give every rank of ``mesh`` the tensor held by mesh coordinate ``(src,)*ndim``.

    Mesh dims are processed in order; at step d only the lines that pass through
    a rank already holding the data take part, so each rank receives once.
    """
    coord = mesh.get_coordinate()
    assert coord is not None, "only ranks of the mesh broadcast"
    src = (src_data_rank,) * mesh.ndim
    out = tensor.detach().contiguous()
    for d in range(mesh.ndim):
        if mesh.size(d) == 1:
            continue
        if all(coord[e] == src[e] for e in range(d + 1, mesh.ndim)):
            group = mesh.get_comm_group(d)
            out = collectives.broadcast(out, group, group.ranks[src[d]])
    return out


def distribute_tensor(tensor: torch.Tensor, device_mesh: Optional[DeviceMesh] = None,
                      placements: Optional[Union[Sequence[Any], Layout]] = None, *,
                      src_data_rank: Optional[int] = 0) -> DTensor:
    """Split a full ``tensor`` over ``device_mesh`` as ``placements``.

    With ``src_data_rank=k`` (default 0) the data of the rank at group rank ``k``
    on every mesh dim is used and sent to the others (broadcast along each mesh
    dim), so ranks may pass different values; with ``src_data_rank=None`` each
    rank slices its own copy with no communication. The result is a leaf that
    requires grad if ``tensor`` does.
    """
    mesh = resolve_mesh(device_mesh, "distribute_tensor")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute_tensor: tensor must be a tensor, got {type(tensor).__name__}")
    if not tensor.is_leaf:
        raise RuntimeError("`distribute_tensor` should be used to distribute leaf tensors! but found non-leaf tensor "
                           f"(grad_fn={type(tensor.grad_fn).__name__}); distribute the leaf and run the ops on the "
                           "DTensor, or pass tensor.detach()")
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    semantics = semantics_of(mesh)
    placements = semantics.trim_placements(mesh, placements, "distribute_tensor")  # HyperParallel's: extras ignored
    if isinstance(placements, (list, tuple)) and not is_alias_spelling(placements) and len(placements) != mesh.ndim \
            and not semantics.short_placement_lists:  # HyperParallel's: shorter lists padded, as from_local
        # as PyTorch (alias names are per tensor dim and checked against the tensor's rank instead)
        raise ValueError(f"`placements` must have the same length as `device_mesh.ndim`! Found placements length: "
                         f"{len(placements)} ({tuple(placements)}), and device_mesh.ndim: {mesh.ndim} ({mesh}).")
    layout = build_layout(mesh, placements, tensor.dim())
    _check_strided_label(placements, layout, tuple(tensor.shape), "distribute_tensor")
    if isinstance(tensor, DTensor):
        if tensor.device_mesh != mesh:
            raise ValueError(f"Cannot distribute a DTensor with device mesh {tensor.device_mesh} "
                             f"to a different device mesh {mesh}.")
        if tensor._layout != layout:
            raise ValueError(f"Cannot distribute a DTensor with placements {tensor.placements} to a different "
                             f"placements {tuple(layout.placements)}. do you want to call `redistribute` instead?")
        return tensor
    if mesh.get_coordinate() is None:  # a rank outside the mesh holds nothing (PyTorch semantics)
        local = _off_mesh_local(tensor.detach())
        local.requires_grad_(tensor.requires_grad and local.is_floating_point())
        return DTensor._wrap(local, mesh, layout, tuple(tensor.shape))
    if layout.has_partial():
        # as PyTorch: distribute as if Replicate, then turn each Partial mesh dim into pending
        # partial values whose reduction is the tensor (exactly: the value on the dim's first
        # rank, the reduction's identity elsewhere, where PyTorch splits a sum as v / n)
        rep = distribute_tensor(tensor.detach(), mesh, layout.without_partial(), src_data_rank=src_data_rank)
        plan = rp.plan(rep._layout, layout, tuple(rep.shape), rep._local_tensor.element_size())
        local = run_plan(rep._local_tensor, plan, mesh, mesh._rank_index())
        local.requires_grad_(tensor.requires_grad)
        _mark_leaf(local)
        return DTensor._wrap(local, mesh, layout, rep._gshape)
    if src_data_rank is not None:
        if not isinstance(src_data_rank, int) or not all(0 <= src_data_rank < s for s in mesh.shape):
            raise ValueError(f"distribute_tensor: src_data_rank={src_data_rank!r} must be a group rank valid on every "
                             f"mesh dim (mesh shape {mesh.shape}) or None")
    requires_grad = tensor.requires_grad
    gshape = tuple(tensor.shape)
    data = tensor.detach()
    local = None
    if src_data_rank is not None:
        local = _scatter_from(data, mesh, layout, src_data_rank)
        if local is None:
            data = _broadcast_from(data, mesh, src_data_rank)
    if local is None:
        local = _slice_local(data, layout, mesh, gshape)
    if local is tensor or local.data_ptr() == tensor.data_ptr():
        local = local.clone()
    local.requires_grad_(requires_grad)
    _mark_leaf(local)
    return DTensor._wrap(local, mesh, layout, gshape)


# ---------------------------------------------------------------------------- distribute_module
def _replicate_params(module, mesh: DeviceMesh):
    rep = [Replicate()] * mesh.ndim
    for key, param in list(module._parameters.items()):
        if param is None or isinstance(param, DTensor):
            continue
        dt = distribute_tensor(param.data, mesh, rep)
        module.register_parameter(key, torch.nn.Parameter(dt, requires_grad=param.requires_grad))
    for key, buf in list(module._buffers.items()):
        if buf is None or isinstance(buf, DTensor):
            continue
        module._buffers[key] = distribute_tensor(buf, mesh, rep)


def _wrap_hook(hook, mesh, kind):
    n = len(inspect.signature(hook).parameters)
    if n == 2:
        warnings.warn(f"Deprecating {kind} that takes two arguments ({'inputs' if kind == 'input_fn' else 'outputs'}, "
                      f"device_mesh); use ({'module, inputs' if kind == 'input_fn' else 'module, outputs'}, "
                      "device_mesh) instead", FutureWarning, stacklevel=4)
        if kind == "input_fn":
            return lambda mod, inputs: hook(inputs, mesh)
        return lambda mod, inputs, outputs: hook(outputs, mesh)
    if n == 3:
        if kind == "input_fn":
            return lambda mod, inputs: hook(mod, inputs, mesh)
        return lambda mod, inputs, outputs: hook(mod, outputs, mesh)
    raise ValueError(f"distribute_module: {kind} should take 2 or 3 arguments, but got {n} arguments")


def distribute_module(module: nn.Module, device_mesh: Optional[DeviceMesh] = None,
                      partition_fn: Optional[Callable] = None,
                      input_fn: Optional[Callable] = None,
                      output_fn: Optional[Callable] = None) -> nn.Module:
    """Distribute a module's parameters and attach input/output hooks (PyTorch contract).

    ``partition_fn(name, submodule, mesh)`` runs on every submodule and may turn
    parameters into DTensors; whatever it leaves as plain tensors is replicated.
    ``input_fn(module, inputs, mesh)`` / ``output_fn(module, outputs, mesh)`` become
    a forward pre-hook / forward hook on ``module`` (the 2-argument forms are
    accepted with a FutureWarning). Calling it twice on one module is an error.
    """
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError("distribute_module should only be called once on a module, "
                           "but it has already been called on this module!")
    mesh = resolve_mesh(device_mesh, "distribute_module")
    pre = _wrap_hook(input_fn, mesh, "input_fn") if input_fn is not None else None
    post = _wrap_hook(output_fn, mesh, "output_fn") if output_fn is not None else None
    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, mesh)
        _replicate_params(sub, mesh)
    if pre is not None:
        module.register_forward_pre_hook(pre)
    if post is not None:
        module.register_forward_hook(post)
    module._distribute_module_applied = True  # type: ignore[assignment]
    return module


# ---------------------------------------------------------------------------- factories
def _parse_size_and_mesh(fn_name, size, device_mesh, placements):
    args = list(size)
    if args and isinstance(args[0], (tuple, list)):
        shape = tuple(int(s) for s in args[0])
        rest = args[1:]
    else:
        shape, rest = [], []
        for i, a in enumerate(args):
            if isinstance(a, int) and not rest:
                shape.append(a)
            else:
                rest = args[i:]
                break
        shape = tuple(shape)
    if rest:  # HyperParallel style: (size, device_mesh, placements)
        if device_mesh is not None or len(rest) > 2:
            raise TypeError(f"{fn_name}: unexpected positional arguments {rest}")
        device_mesh = rest[0]
        if len(rest) == 2:
            placements = rest[1]
    for s in shape:
        if not isinstance(s, int) or s < 0:
            raise ValueError(f"{fn_name}: size must be non-negative ints, got {shape}")
    mesh = resolve_mesh(device_mesh, fn_name)
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    layout = build_layout(mesh, placements, len(shape))
    if layout.has_partial():
        raise ValueError(f"{fn_name}: placements {layout.placements} contain Partial; factories create sharded or "
                         "replicated tensors")
    return shape, mesh, layout


def _device(mesh):
    return groups.default_device(mesh.device_type)


def _factory(fn_name, make_local, size, device_mesh, placements, dtype, requires_grad):
    shape, mesh, layout = _parse_size_and_mesh(fn_name, size, device_mesh, placements)
    lshape, offset = layout.local_shape_and_offset(shape, coord=mesh.get_coordinate())
    local = make_local(lshape, offset, shape, mesh)
    if requires_grad:
        local.requires_grad_(True)
        _mark_leaf(local)
    return DTensor._wrap(local, mesh, layout, shape)


def ones(*size: Union[int, Sequence[int]], device_mesh: Optional[DeviceMesh] = None,
         placements: Optional[Sequence[Any]] = None, dtype: Optional[torch.dtype] = None,
         requires_grad: bool = False) -> DTensor:
    """DTensor of ones with global shape ``size``."""
    return _factory("ones", lambda s, o, g, m: torch.ones(s, dtype=dtype, device=_device(m)),
                    size, device_mesh, placements, dtype, requires_grad)


def zeros(*size: Union[int, Sequence[int]], device_mesh: Optional[DeviceMesh] = None,
          placements: Optional[Sequence[Any]] = None, dtype: Optional[torch.dtype] = None,
          requires_grad: bool = False) -> DTensor:
    """DTensor of zeros with global shape ``size``."""
    return _factory("zeros", lambda s, o, g, m: torch.zeros(s, dtype=dtype, device=_device(m)),
                    size, device_mesh, placements, dtype, requires_grad)


def empty(*size: Union[int, Sequence[int]], device_mesh: Optional[DeviceMesh] = None,
          placements: Optional[Sequence[Any]] = None, dtype: Optional[torch.dtype] = None,
          requires_grad: bool = False) -> DTensor:
    """Uninitialised DTensor with global shape ``size``."""
    return _factory("empty", lambda s, o, g, m: torch.empty(s, dtype=dtype, device=_device(m)),
                    size, device_mesh, placements, dtype, requires_grad)


def full(size: Sequence[int], fill_value: Union[int, float, bool], *, device_mesh: Optional[DeviceMesh] = None,
         placements: Optional[Sequence[Any]] = None, dtype: Optional[torch.dtype] = None,
         requires_grad: bool = False) -> DTensor:
    """DTensor filled with ``fill_value`` with global shape ``size``."""
    return _factory("full", lambda s, o, g, m: torch.full(s, fill_value, dtype=dtype, device=_device(m)),
                    (tuple(size),), device_mesh, placements, dtype, requires_grad)


def rand(*size: Union[int, Sequence[int]], device_mesh: Optional[DeviceMesh] = None,
         placements: Optional[Sequence[Any]] = None, dtype: Optional[torch.dtype] = None,
         requires_grad: bool = False) -> DTensor:
    """Uniform [0, 1) DTensor; values depend only on the seed, never on the layout."""
    return _factory("rand", lambda s, o, g, m: dt_random.random_local("rand", g, s, o, dtype, _device(m)),
                    size, device_mesh, placements, dtype, requires_grad)


def randn(*size: Union[int, Sequence[int]], device_mesh: Optional[DeviceMesh] = None,
          placements: Optional[Sequence[Any]] = None, dtype: Optional[torch.dtype] = None,
          requires_grad: bool = False) -> DTensor:
    """Standard normal DTensor; values depend only on the seed, never on the layout."""
    return _factory("randn", lambda s, o, g, m: dt_random.random_local("randn", g, s, o, dtype, _device(m)),
                    size, device_mesh, placements, dtype, requires_grad)


__all__ = ["distribute_tensor", "distribute_module", "ones", "zeros", "empty", "full", "rand", "randn"]

# HyperParallel keeps these in hyper_parallel.dtensor.dtensor: make them importable there too
provide_dtensor_names(distribute_tensor=distribute_tensor, distribute_module=distribute_module, ones=ones,
                      zeros=zeros, empty=empty, full=full, rand=rand, randn=randn)
