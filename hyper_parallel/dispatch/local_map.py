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
from typing import Callable, Optional, Sequence

from hyper_parallel.dtensor.device_mesh import DeviceMesh, adopt_foreign_mesh, get_current_mesh
from hyper_parallel.dtensor.dtensor import DTensor, build_layout
from hyper_parallel.dtensor.placement_types import Placement
from hyper_parallel.dtensor.redistribute import partial_grad_view


def _non_replicated_mesh_dims(out_placements, mesh) -> set:
    """Mesh dims on which some declared output is sharded or Partial."""
    specs = [out_placements] if _is_spec(out_placements) else list(out_placements)
    dims = set()
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


def _is_spec(x) -> bool:
    """A single placement spec (one output), as opposed to a sequence of per-output specs."""
    if x is None:
        return True
    items = list(x)
    return all(isinstance(p, (Placement, str)) for p in items) or (
        bool(items) and all(isinstance(p, tuple) and all(isinstance(q, str) for q in p) for p in items))


def local_map(func: Callable, out_placements, in_placements: Optional[Sequence] = None,
              device_mesh: Optional[DeviceMesh] = None, *, redistribute_inputs: bool = False):
    """Wrap ``func`` (which works on local tensors) so it takes and returns DTensors.

    Args:
        func: function of plain tensors.
        out_placements: placements of each output (a single placement spec for one
            output, a tuple of them for several; ``None`` for a non-tensor output).
        in_placements: placements expected for each positional argument (``None``
            entries for non-DTensor arguments); ``None`` accepts inputs as they are.
        device_mesh: mesh for the outputs (default: the inputs' mesh, or the current one).
        redistribute_inputs: redistribute mismatched inputs instead of raising.
    """
    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        mesh = adopt_foreign_mesh(device_mesh)
        local_args = []
        for i, a in enumerate(args):
            if isinstance(a, DTensor):
                mesh = mesh or a.device_mesh
                want = in_placements[i] if in_placements is not None else None
                if want is not None:
                    lay = build_layout(a.device_mesh, want, a.ndim, f"local_map in_placements[{i}]")
                    if lay != a.layout:
                        if not redistribute_inputs:
                            raise ValueError(
                                f"local_map({getattr(func, '__name__', func)}): argument {i} has placements "
                                f"{a.placements} but in_placements[{i}] is {tuple(want)}; pass "
                                "redistribute_inputs=True to redistribute automatically")
                        a = a.redistribute(a.device_mesh, lay)
                local = a.to_local()
                if local.requires_grad:
                    lay = a.layout
                    for d in sorted(_non_replicated_mesh_dims(out_placements, a.device_mesh)):
                        if lay.partial[d] is None and lay.tensor_dim_of(d) is None and a.device_mesh.size(d) > 1:
                            local = partial_grad_view(local, a.device_mesh.get_comm_group(d))
                local_args.append(local)
            else:
                if in_placements is not None and i < len(in_placements) and in_placements[i] is not None:
                    raise TypeError(f"local_map: argument {i} should be a DTensor with placements "
                                    f"{in_placements[i]}, got {type(a).__name__}")
                local_args.append(a)
        mesh = mesh or get_current_mesh()
        out = func(*local_args, **kwargs)
        if mesh is None:
            return out
        single = not isinstance(out, (tuple, list))
        outs = (out,) if single else out
        pls = (out_placements,) if single else out_placements
        if len(pls) != len(outs):
            raise ValueError(f"local_map: {len(outs)} outputs but {len(pls)} out_placements")
        res = [DTensor.from_local(o, mesh, p) if p is not None and hasattr(o, "dim") else o
               for o, p in zip(outs, pls)]
        return res[0] if single else type(out)(res)
    return wrapped


custom_shard = local_map
