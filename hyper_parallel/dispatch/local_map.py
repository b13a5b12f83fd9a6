"""local_map / custom_shard: run a plain-tensor function on local shards.

``local_map(fn, out_placements, in_placements)`` returns a function that takes
DTensors, checks (or, with ``redistribute_inputs=True``, redistributes) them to
``in_placements``, calls ``fn`` on their local tensors, and wraps the results as
DTensors with ``out_placements``. Autograd flows through unchanged, because a
DTensor and its local tensor share one autograd graph.

Gradients follow the dispatcher's rule: an input that is replicated on a mesh
dim where some output is sharded or Partial only sees, on each rank, the part
of the gradient that comes from that rank's output piece; those parts are
summed over the mesh dim in the backward pass (one all_reduce), so the
gradient of a replicated input is the full gradient on every rank.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

from hyper_parallel.dtensor.device_mesh import DeviceMesh, adopt_foreign_mesh, get_current_mesh
from hyper_parallel.dtensor.dtensor import DTensor, build_layout
from hyper_parallel.dtensor.placement_types import Placement
from hyper_parallel.dtensor.redistribute import partial_grad_view
import torch.utils._pytree


def _non_replicated_mesh_dims(out_placements, mesh) -> set:
    """Mesh dims on which some declared output is sharded or Partial."""
    specs = [out_placements] if _is_spec(out_placements) else list(out_placements)
    dims: set = set()
    for spec in specs:
        if spec is None:
            continue
        items = list(spec)
        if all(isinstance(p, Placement) for p in items):
            dims.update(d for d, p in enumerate(items) if not p.is_replicate())
            continue
        names = mesh.mesh_dim_names or ()
        for it in items:   # alias spelling: one entry per tensor dim, mesh-dim names or "None"
            for n in ((it,) if isinstance(it, str) else tuple(it)):
                if n in names:
                    dims.add(names.index(n))
    return dims


def _is_spec(spec) -> bool:
    """A single placement spec (one output), as opposed to a sequence of per-output specs."""
    if spec is None:
        return True
    items = list(spec)
    return all(isinstance(p, (Placement, str)) for p in items) or (
        bool(items) and all(isinstance(p, tuple) and all(isinstance(q, str) for q in p) for p in items))


def _same_placements(dtensor, want) -> bool:
    want = tuple(want)
    return all(isinstance(p, Placement) for p in want) and tuple(dtensor.placements) == want


def _per_output(out_placements) -> bool:
    """torch reads a tuple ``out_placements`` as one spec per output (``((Partial(),),)``: one output);
    a tuple of placements / alias names (HyperParallel's spelling) and a list are one output's spec."""
    return isinstance(out_placements, tuple) and not _is_spec(out_placements)


def local_map(func: Optional[Callable] = None, out_placements: Any = None, in_placements: Optional[Sequence] = None,
              in_grad_placements: Optional[Sequence] = None, device_mesh: Optional[DeviceMesh] = None, *,
              redistribute_inputs: bool = False) -> Callable:
    """Wrap ``func`` (which works on local tensors) so it takes and returns DTensors (torch 2.13's signature).

    Args:
        func: function of plain tensors; ``None`` returns a decorator.
        out_placements: placements of the flattened output: one spec for a single output (a list or
            tuple of placements, or alias names), a tuple of specs (one per flattened output, as torch:
            ``((Partial(),),)`` for one output); ``None`` for a non-tensor output.
        in_placements: placements expected for each flattened positional argument (``None`` entries
            for non-DTensor arguments); ``None`` accepts inputs as they are.
        in_grad_placements: placements of the gradient of each flattened DTensor argument's local
            tensor (torch's ``to_local(grad_placements=)`` hint, e.g. ``Partial()`` for a replicated
            input whose local gradient is a partial sum); default: the automatic rule of the module
            docstring.
        device_mesh: mesh for the outputs (default: the first DTensor argument's mesh, or the current one).
        redistribute_inputs: redistribute mismatched inputs instead of raising.
    """
    if func is None:
        def decorated(func):
            return local_map(func, out_placements, in_placements, in_grad_placements, device_mesh,
                             redistribute_inputs=redistribute_inputs)
        return decorated
    return functools.partial(_local_map_wrapped, func, out_placements, in_placements, in_grad_placements,
                             device_mesh, redistribute_inputs)


def _local_map_wrapped(func, out_placements, in_placements, in_grad_placements, device_mesh, redistribute_inputs,
                       *args, **kwargs):
    fname = getattr(func, "__name__", func)
    mesh = adopt_foreign_mesh(device_mesh)
    flat_args, args_spec = torch.utils._pytree.tree_flatten(args)
    for what, pl in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
        if pl is not None and len(pl) != len(flat_args):
            raise ValueError(f"local_map({fname}): {what} has {len(pl)} entries but the function got "
                             f"{len(flat_args)} (flattened) positional arguments; expected one entry per argument")
    local_args = []
    for i, a in enumerate(flat_args):
        if isinstance(a, DTensor):
            mesh = mesh or a.device_mesh
            want = in_placements[i] if in_placements is not None else None
            if in_placements is not None and want is None:
                raise ValueError(f"local_map({fname}): argument {i} is a DTensor but in_placements[{i}] is None; "
                                 "expected its placements")
            # placement objects equal to the input's need no layout (and keep torch.compile out of the
            # layout cache: dynamo traces this wrapper inside compiled blocks)
            if want is not None and not _same_placements(a, want):
                lay = build_layout(a.device_mesh, want, a.ndim, f"local_map in_placements[{i}]")
                if lay != a._layout:
                    if not redistribute_inputs:
                        raise ValueError(
                            f"local_map({fname}): argument {i} has placements "
                            f"{a.placements} but in_placements[{i}] is {tuple(want)}; pass "
                            "redistribute_inputs=True to redistribute automatically")
                    a = a.redistribute(a.device_mesh, lay)
            grad_pl = in_grad_placements[i] if in_grad_placements is not None else None
            if in_grad_placements is not None and grad_pl is None:
                raise ValueError(f"local_map({fname}): argument {i} is a DTensor but in_grad_placements[{i}] "
                                 "is None; expected the placements of its gradient")
            if grad_pl is not None:
                local_args.append(a.to_local(grad_placements=tuple(grad_pl)))
                continue
            local = a.to_local()
            if local.requires_grad:
                lay = a._layout
                for d in sorted(_non_replicated_mesh_dims(out_placements, a.device_mesh)):
                    if lay.partial[d] is None and lay.tensor_dim_of(d) is None and a.device_mesh.size(d) > 1:
                        local = partial_grad_view(local, a.device_mesh.get_comm_group(d))
            local_args.append(local)
        else:
            if in_placements is not None and in_placements[i] is not None and not hasattr(a, "dim"):
                raise TypeError(f"local_map({fname}): argument {i} should be a DTensor with placements "
                                f"{in_placements[i]}, got {type(a).__name__}")
            local_args.append(a)
    mesh = mesh or get_current_mesh()
    out = func(*torch.utils._pytree.tree_unflatten(local_args, args_spec), **kwargs)
    if mesh is None:
        return out
    flat_out, out_spec = torch.utils._pytree.tree_flatten(out)
    pls = tuple(out_placements) if _per_output(out_placements) else (
        (out_placements,) if len(flat_out) == 1 or _is_spec(out_placements) else tuple(out_placements))
    if len(pls) != len(flat_out):
        raise ValueError(f"local_map({fname}): {len(flat_out)} outputs but {len(pls)} out_placements "
                         f"({out_placements!r}); expected one placement spec per (flattened) output")
    res = []
    for i, (o, p) in enumerate(zip(flat_out, pls)):
        if hasattr(o, "dim"):
            if isinstance(o, DTensor):
                raise TypeError(f"local_map({fname}): output {i} is a DTensor; the function must return plain "
                                "tensors")
            res.append(DTensor.from_local(o, mesh, p) if p is not None else o)
        else:
            if p is not None:
                raise ValueError(f"local_map({fname}): output {i} is a {type(o).__name__}, not a tensor, but "
                                 f"out_placements gives it {p!r}; expected None")
            res.append(o)
    return torch.utils._pytree.tree_unflatten(res, out_spec)


custom_shard = local_map
