"""torch mechanics behind HyperParallel's pipeline API (``hyper_parallel.core.pipeline_parallel``).

The HyperParallel-style classes (``pipeline_api.py`` beside this file) are framework-neutral
wrappers; what needs torch is here, and all of it drives the same objects as the PyTorch-style
API: :class:`hyper_parallel.pipelining.PipelineStage` and torch's schedule runtime.

* :func:`pp_group` - the pipeline process group of a HyperParallel stage (its ``group``, its
  1-D ``mesh``, or HyperParallel's rank arithmetic: pipeline outermost, ``world / pp`` ranks
  per stage);
* :class:`StageOutputs` - the ``loss_fn`` handed to torch's schedule: HyperParallel's last stage
  *returns* the loss, so the "loss" of a microbatch is the stage's output itself (summed if it is
  not a scalar: HyperParallel back-propagates a gradient of ones), and the outputs are kept so
  ``run`` can return them concatenated;
* :func:`run` - one ``step`` of the torch schedule (target: a placeholder split into the
  microbatches; gradients not scaled) and the concatenated last-stage outputs;
* :func:`exec_order` - torch's per-rank action lists as ``(stage, kind, microbatch)`` tuples.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import TensorChunkSpec

from hyper_parallel.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.dtensor.dtensor import DTensor

__all__ = ["default_device", "pp_group", "chunk_specs", "StageOutputs", "run", "exec_order"]

_GROUPS = {}


def default_device():
    """The device HyperParallel's stage defaults to: the current accelerator, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pp_group(stage_index, stage_num, n_local, mesh, group, where):
    """``(process group, pipeline size)`` of a HyperParallel stage, checked against its stage index."""
    real = stage_num // n_local
    if stage_num % n_local:
        raise ValueError(f"{where}: stage_num={stage_num} is not a multiple of the {n_local} stages this rank "
                         "runs; every rank must run the same number of stages")
    if group is not None:
        return group, dist.get_world_size(group)
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
            raise ValueError(f"{where}: mesh must be a 1-D pipeline DeviceMesh (e.g. root_mesh['pp']), got {mesh!r}")
        if mesh.size() != real:
            raise ValueError(f"{where}: stage_num={stage_num} with {n_local} stage(s) per rank needs a pipeline of "
                             f"{real} ranks, but mesh {mesh} has {mesh.size()}; expected stage_num == "
                             f"{mesh.size()} x {n_local}")
        return mesh.get_group(), real
    world = dist.get_world_size()
    if world % real:
        raise ValueError(f"{where}: stage_num={stage_num} with {n_local} stage(s) per rank makes {real} pipeline "
                         f"ranks, which does not divide the world size {world}; pass mesh= or group=")
    if world == real:
        return dist.group.WORLD, real
    # HyperParallel's rank arithmetic: the pipeline is the outermost dim, world / pp ranks per stage
    key = (world, real)
    m = _GROUPS.get(key)
    if m is None:
        m = _GROUPS[key] = init_device_mesh(default_device().type, (real, world // real),
                                            mesh_dim_names=("pp", "stage_ranks"))["pp"]
    return m.get_group(), real


def chunk_specs(args_dims, kwargs_dims):
    """HyperParallel batch dims (ints or None) -> torch's ``TensorChunkSpec``s."""
    a = None if args_dims is None else tuple(TensorChunkSpec(0 if d is None else d) for d in args_dims)
    k = None if kwargs_dims is None else {n: TensorChunkSpec(0 if d is None else d) for n, d in kwargs_dims.items()}
    return a, k


def _as_loss(out):
    if isinstance(out, (tuple, list)):
        parts = [_as_loss(o) for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
        if not parts:
            raise ValueError("the last stage returned no tensor that requires grad; its output is the loss")
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total
    return out if out.dim() == 0 else out.sum()


class StageOutputs:
    """torch's ``loss_fn`` for HyperParallel's semantics: the last stage's output is the loss."""

    def __init__(self):
        self.outputs = []

    def __call__(self, output, target=None):
        self.outputs.append(output)
        return _as_loss(output)


def _cat(outs, dim):
    first = outs[0]
    if isinstance(first, (tuple, list)):
        return type(first)(_cat([o[i] for o in outs], dim) for i in range(len(first)))
    if not isinstance(first, torch.Tensor):
        return list(outs)
    outs = [o.detach() for o in outs]
    if first.dim() == 0:
        return torch.stack(outs)
    return torch.cat(outs, dim=dim)


def run(sched, collect: StageOutputs, n_micro, has_first, has_last, concat_dim, device, args, kwargs):
    """One training step of torch schedule ``sched``; the last stage's outputs concatenated (else ``None``)."""
    collect.outputs = []
    target = torch.zeros(n_micro, device=device) if has_last else None
    sched.step(*(args if has_first else ()), target=target, losses=[] if has_last else None,
               return_outputs=False, **kwargs)
    if not has_last:
        return None
    outs = collect.outputs[-n_micro:]
    return _cat(outs, 0 if concat_dim is None else concat_dim)


def exec_order(sched):
    """torch's per-rank action lists (with the communication actions where torch lowered them)."""
    order = getattr(sched, "pipeline_order_with_comms", None) or getattr(sched, "pipeline_order", None) or {}
    out = {}
    for rank, actions in order.items():
        row = []
        for a in actions:
            if a is None:
                row.append(None)
                continue
            subs = None
            if a.sub_actions:
                subs = tuple((s.stage_index, s.computation_type.value, s.microbatch_index) for s in a.sub_actions)
            row.append((a.stage_index, a.computation_type.value, a.microbatch_index, subs))
        out[rank] = row
    return out


def is_dtensor(value):
    return isinstance(value, DTensor)
