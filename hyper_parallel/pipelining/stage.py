"""``PipelineStage``: torch's pipeline stage, with hyper_parallel DTensors at its boundaries.

torch's stage (``torch.distributed.pipelining.PipelineStage``) moves plain tensors: it infers
their metadata on the first step (a real forward/backward of the first microbatch), allocates
receive buffers from it and sends and receives tensors point to point. It knows torch's DTensor,
not ours. This subclass keeps every buffer, message and schedule action torch's and changes what
the stage's module sees:

* **Boundary = local tensor + layout sent once.** A DTensor a non-last stage returns is handed to
  torch as its local tensor (made contiguous), and its layout (mesh dim names and shape,
  placements, global shape and stride, this rank's mesh coordinate) is recorded. The layouts
  travel once, with the forward metadata torch sends on the first step (``_send_meta`` carries
  them next to torch's metadata); the receiving stage rebuilds each input with
  ``DTensor.from_local`` on its own mesh of the same dim names and shape (found among its
  submodule's DTensor parameters, its example ``input_args``, or through ``get_mesh``). Per
  microbatch only the local tensor moves.
* **Gradients need no layout.** autograd runs on local tensors here (``from_local`` and
  ``to_local`` add no autograd node), so the gradient torch sends back for an output's local
  tensor *is* the local gradient of that DTensor under the library's convention (Shard: sharded
  alike; Replicate/Partial: the full gradient on every rank).
* **Shape inference** works because torch infers the shapes of the local tensors.
* **Our ``FSDPModule``** stage modules get what torch's schedules give torch's FSDP2: gradient
  sync and reshard-after-backward off for every microbatch but the last (gradients accumulate
  unsharded), on for the last, so each group reduce-scatters once per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
from torch.distributed.pipelining._utils import InferenceMode, _StageForwardMeta

from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.fsdp.api import FSDPModule, set_replicate_gradient_sync

__all__ = ["PipelineStage", "HeteroPipelineStage", "BoundaryLayout"]


@dataclass(frozen=True)
class BoundaryLayout:
    """How to rebuild one boundary DTensor from its local tensor (picklable, mesh-independent)."""

    mesh_dim_names: Optional[tuple]
    mesh_shape: tuple
    placements: tuple
    shape: tuple
    stride: tuple
    coordinate: Optional[tuple]

    @staticmethod
    def of(dtensor: DTensor) -> "BoundaryLayout":
        m = dtensor.device_mesh
        return BoundaryLayout(tuple(m.mesh_dim_names) if m.mesh_dim_names else None, tuple(m.shape),
                              tuple(dtensor.placements), tuple(dtensor.shape), tuple(dtensor.stride()),
                              tuple(m.get_coordinate()) if m.get_coordinate() is not None else None)

    def describe(self) -> str:
        return (f"DTensor{list(self.shape)} on mesh {self.mesh_dim_names or ''}{list(self.mesh_shape)} "
                f"placements {self.placements}")


@dataclass(frozen=True)
class _MetaWithLayouts:
    """torch's stage metadata plus the layouts of the DTensor outputs it describes."""

    meta: Any
    layouts: Optional[tuple]


@dataclass(frozen=True)
class _BoundaryError:
    """Sent to a neighbour stage instead of its next metadata message: the boundary check failed here."""

    message: str


# layouts of the stages on this rank, for a neighbour on the same rank (V schedules pass
# metadata between same-rank stages by return value, not by message)
_LOCAL_LAYOUTS: dict = {}
# declared boundary metadata of the stages on this rank (STATIC mode's check, same-rank neighbours)
_LOCAL_STATIC: dict = {}


def _describe_metas(metas) -> str:
    if metas is None:
        return "nothing"
    parts = []
    for m in metas:
        parts.append("None" if m is None else f"{list(m.shape)} {str(m.dtype).replace('torch.', '')}")
    return "(" + ", ".join(parts) + ")"


def _metas_key(metas):
    return None if metas is None else tuple(None if m is None else (tuple(m.shape), m.dtype) for m in metas)


def _is_tensor(obj):
    return isinstance(obj, torch.Tensor)


class PipelineStage(_TorchPipelineStage):
    """torch 2.13's ``PipelineStage`` whose boundary tensors may be hyper_parallel DTensors.

    Arguments are torch's: ``submodule``, ``stage_index``, ``num_stages``, ``device``, the optional
    example tensors ``input_args`` / ``output_args`` / ``output_grads`` / ``input_grads`` (static
    metadata; hyper_parallel DTensors allowed), ``group`` (the pipeline process group; a 1-D
    hyper_parallel ``DeviceMesh`` is accepted too), ``dw_builder`` and ``get_mesh``. ``get_mesh``
    is called as ``get_mesh(mesh_dim_names, mesh_shape)`` and returns this rank's hyper_parallel
    ``DeviceMesh`` for a boundary DTensor whose mesh the stage cannot find among its own
    DTensors.
    """

    def __init__(self, submodule, stage_index: int, num_stages: int, device, input_args=None, output_args=None,
                 output_grads=None, input_grads=None, group=None, dw_builder=None, get_mesh=None):
        if not isinstance(submodule, torch.nn.Module):
            raise TypeError(f"PipelineStage: submodule must be an nn.Module, got {type(submodule).__name__}")
        for arg, v in (("stage_index", stage_index), ("num_stages", num_stages)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"PipelineStage: {arg} must be an int, got {v!r}")
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index={stage_index} is out of range for "
                             f"num_stages={num_stages}; expected 0 <= stage_index < num_stages")
        if isinstance(group, DeviceMesh):
            if group.ndim != 1:
                raise ValueError(f"PipelineStage: group must be a ProcessGroup or a 1-D DeviceMesh (the pipeline "
                                 f"mesh dim), got a {group.ndim}-D mesh {group}")
            group = group.get_group()
        if get_mesh is not None and not callable(get_mesh):
            raise TypeError(f"PipelineStage: get_mesh must be callable, got {get_mesh!r}")
        self._hp_get_mesh = get_mesh
        self._hp_meshes = []
        in_lay = self._hp_static(input_args)
        out_lay = self._hp_static(output_args)
        super().__init__(submodule, stage_index, num_stages, device,
                         input_args=self._hp_localize_static(input_args),
                         output_args=self._hp_localize_static(output_args),
                         output_grads=self._hp_localize_static(output_grads),
                         input_grads=self._hp_localize_static(input_grads),
                         group=group, dw_builder=dw_builder)
        self._hp_in_layouts = in_lay if stage_index > 0 else None
        self._hp_out_layouts = out_lay
        for m in submodule.modules():
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                if isinstance(t, DTensor):
                    self._hp_add_mesh(t.device_mesh)

    # ------------------------------------------------------------------ static example args
    def _hp_static(self, args):
        if args is None:
            return None
        args = args if isinstance(args, (tuple, list)) else (args,)
        lay = tuple(BoundaryLayout.of(a) if isinstance(a, DTensor) else None for a in args)
        for a in args:
            if isinstance(a, DTensor):
                self._hp_add_mesh(a.device_mesh)
        return lay if any(x is not None for x in lay) else None

    @staticmethod
    def _hp_localize_static(args):
        if args is None:
            return None
        single = not isinstance(args, (tuple, list))
        seq = (args,) if single else args
        out = tuple(a._local_tensor.detach().contiguous().requires_grad_(a.requires_grad)
                    if isinstance(a, DTensor) else a for a in seq)
        return out[0] if single else out

    def _hp_add_mesh(self, mesh):
        if mesh not in self._hp_meshes:
            self._hp_meshes.append(mesh)

    # ------------------------------------------------------------------ mesh lookup
    def _hp_mesh_for(self, lay: BoundaryLayout):
        want_names, want_shape = lay.mesh_dim_names, tuple(lay.mesh_shape)
        for m in self._hp_meshes:
            names = tuple(m.mesh_dim_names) if m.mesh_dim_names else None
            if names == want_names and tuple(m.shape) == want_shape:
                return self._hp_check_coord(m, lay)
            if want_names and names and set(want_names) <= set(names) and names != want_names:
                sub = m[want_names if len(want_names) > 1 else want_names[0]]
                if tuple(sub.shape) == want_shape:
                    self._hp_add_mesh(sub)
                    return self._hp_check_coord(sub, lay)
        if self._hp_get_mesh is not None:
            m = self._hp_get_mesh(want_names, want_shape)
            if not isinstance(m, DeviceMesh) or tuple(m.shape) != want_shape:
                raise ValueError(f"PipelineStage {self.stage_index}: get_mesh({want_names}, {want_shape}) returned "
                                 f"{m!r}; expected a hyper_parallel DeviceMesh of shape {want_shape}")
            self._hp_add_mesh(m)
            return self._hp_check_coord(m, lay)
        raise ValueError(f"PipelineStage {self.stage_index}: stage {self.stage_index - 1} sends a "
                         f"{lay.describe()}, and this stage has no mesh with mesh dim names {want_names} and shape "
                         f"{want_shape} (looked at its submodule's DTensor parameters and its input_args); "
                         f"pass get_mesh=lambda names, shape: <this rank's mesh> to PipelineStage")

    def _hp_check_coord(self, mesh, lay):
        coord = mesh.get_coordinate()
        if lay.coordinate is not None and coord is not None and tuple(coord) != tuple(lay.coordinate):
            raise ValueError(f"PipelineStage {self.stage_index}: this rank is at coordinate {tuple(coord)} of "
                             f"its mesh {mesh}, but its peer on stage {self.stage_index - 1} holds the shard at "
                             f"coordinate {lay.coordinate} of a {lay.describe()}; the pipeline group must pair "
                             "ranks with equal coordinates on the other mesh dims (build it as mesh['pp'] of "
                             "one root mesh)")
        return mesh

    # ------------------------------------------------------------------ boundary conversion
    def _hp_wrap_inputs(self, args):
        lay = self._hp_in_layouts
        if self.is_first or not lay:
            return args
        out = list(args)
        for i, (a, b) in enumerate(zip(args, lay)):
            if b is None or not _is_tensor(a) or isinstance(a, DTensor):
                continue
            # a fresh alias per microbatch: gradient views cached on the local tensor stay per microbatch
            local = a.view_as(a) if a.requires_grad and torch.is_grad_enabled() else a
            out[i] = DTensor.from_local(local, self._hp_mesh_for(b), b.placements, shape=b.shape, stride=b.stride)
        return tuple(out)

    def _hp_unwrap_outputs(self, output):
        if self.is_last:
            return output
        seq = output if isinstance(output, (tuple, list)) else (output,)
        lay = tuple(BoundaryLayout.of(o) if isinstance(o, DTensor) else None for o in seq)
        if not any(x is not None for x in lay):
            lay = None
        known = self._hp_out_layouts
        if known is not None and lay is not None and known != lay:
            diffs = [f"output {i}: {a.describe() if a else 'plain tensor'} now, "
                     f"{b.describe() if b else 'plain tensor'} on the first step"
                     for i, (a, b) in enumerate(zip(lay, known)) if a != b]
            raise ValueError(f"PipelineStage {self.stage_index}: the stage's outputs changed layout between "
                             f"microbatches ({'; '.join(diffs)}); the next stage rebuilds them from the "
                             "first step's layouts")
        if lay is not None:
            self._hp_out_layouts = lay
        if lay is None:
            return output
        locs = [o.to_local().contiguous() if isinstance(o, DTensor) else o for o in seq]
        self._hp_check_grad_path(locs)
        return locs[0] if not isinstance(output, (tuple, list)) else type(output)(locs)

    def _hp_check_grad_path(self, outs):
        """A non-last stage with trainable parameters whose outputs carry no gradient path would get no
        gradients at all (torch's backward skips such outputs silently): say so instead."""
        if not torch.is_grad_enabled() or any(_is_tensor(o) and o.requires_grad for o in outs):
            return
        if any(p.requires_grad for p in self.submod.parameters()):
            raise RuntimeError(
                f"PipelineStage {self.stage_index}: none of the stage's outputs requires grad although its "
                "module has trainable parameters, so backward would leave them without gradients. A usual "
                "cause: a forward hook that builds the boundary DTensor traced inside torch.compile of the "
                "module call; compile the block's forward instead (block.forward = torch.compile(block.forward))")

    def _hp_forward(self, call, args, kwargs):
        return self._hp_unwrap_outputs(call(*self._hp_wrap_inputs(args), **kwargs))

    # torch's two module calls: the runtime forward and the metadata-inference forward
    def forward_maybe_with_nosync(self, *args, **kwargs):
        return self._hp_forward(super().forward_maybe_with_nosync, args, kwargs)

    def _compute_outputs(self, *args, module, **kwargs):
        try:
            return self._hp_forward(
                lambda *a, **k: super(PipelineStage, self)._compute_outputs(*a, module=module, **k), args, kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised with the boundary named
            if self.is_first:
                raise
            k = self.stage_index
            msg = (f"PipelineStage {k}: its module fails on the inputs stage {k - 1} sends it, "
                   f"{_describe_metas(self._stage_meta.inputs)} ({type(e).__name__}: {e}); if the boundary of "
                   f"stages {k - 1} and {k} disagrees, make stage {k - 1}'s outputs what stage {k}'s module "
                   "takes")
            self._hp_notify(msg, has_backward=torch.is_grad_enabled())
            raise ValueError(msg) from e

    # ------------------------------------------------------------------ layouts with torch's metadata
    def _hp_local_key(self, stage_index):
        return (id(self.group), stage_index)

    def _forward_metadata_inference(self, args, kwargs=None, has_backward=False):
        if not self.is_first and self._is_same_rank(self.stage_index - 1):
            self._hp_in_layouts = _LOCAL_LAYOUTS.get(self._hp_local_key(self.stage_index - 1), self._hp_in_layouts)
        res = super()._forward_metadata_inference(args, kwargs, has_backward)
        _LOCAL_LAYOUTS[self._hp_local_key(self.stage_index)] = self._hp_out_layouts
        return res

    # ------------------------------------------------------------------ boundary checks (first step)
    def _hp_notify(self, msg, has_backward=True):
        """Tell the neighbours on other ranks, which wait for a metadata message from this stage."""
        k = self.stage_index
        peers = [k + 1] + ([k - 1] if has_backward else [])
        for peer in peers:
            if 0 <= peer < self.num_stages and not self._is_same_rank(peer):
                super()._send_meta(_BoundaryError(msg), peer)

    def _hp_compare(self, declared, received, who_declared, who_sent):
        """Raise (naming both stages and shapes) when stage ``who_sent``'s outputs disagree with
        stage ``who_declared``'s declared inputs."""
        if declared is None or received is None or _metas_key(declared) == _metas_key(received):
            return None
        return (f"PipelineStage {self.stage_index}: the boundary of stages {who_sent} and {who_declared} "
                f"disagrees: stage {who_sent} outputs {_describe_metas(received)}, stage {who_declared} takes "
                f"{_describe_metas(declared)} (its input_args); build the stages so that they match")

    def _validate_inferred_metadata(self):
        # DYNAMIC mode: torch only warns when the inputs it received differ from input_args
        if not self.is_first:
            msg = self._hp_compare(self._user_meta.inputs, self._stage_meta.inputs, self.stage_index,
                                   self.stage_index - 1)
            if msg is not None:
                self._hp_notify(msg)
                raise ValueError(msg)
        super()._validate_inferred_metadata()

    def _prepare_forward_infra(self, num_microbatches, args, kwargs=None, has_backward=False):
        if self._inference_mode == InferenceMode.STATIC and not getattr(self, "_hp_static_checked", False):
            self._hp_static_checked = True
            self._hp_static_boundary_check()
        return super()._prepare_forward_infra(num_microbatches, args, kwargs, has_backward)

    def _hp_static_boundary_check(self):
        """STATIC mode (every stage gave example args): torch exchanges nothing, so a boundary whose
        two sides were declared differently would move wrongly sized buffers. Once, on the first step,
        each pair of neighbours exchanges its declared metadata (outputs forward, inputs back) and
        both sides raise on a mismatch."""
        k, key = self.stage_index, id(self.group)
        ins, outs = self._user_meta.inputs, self._user_meta.outputs
        _LOCAL_STATIC[(key, k)] = (ins, outs)
        err = None
        if not self.is_first:
            if self._is_same_rank(k - 1):
                prev_outs = _LOCAL_STATIC.get((key, k - 1), (None, None))[1]
            else:
                prev_outs = super()._recv_meta(k - 1)
                super()._send_meta(ins, k - 1)
            err = self._hp_compare(ins, prev_outs, k, k - 1)
        if not self.is_last and not self._is_same_rank(k + 1):
            super()._send_meta(outs, k + 1)
            next_ins = super()._recv_meta(k + 1)
            err = err or self._hp_compare(next_ins, outs, k + 1, k)
        if err is not None:
            raise ValueError(err)

    def _send_meta(self, meta, dst_stage):
        lay = self._hp_out_layouts if isinstance(meta, _StageForwardMeta) else None
        super()._send_meta(_MetaWithLayouts(meta, lay), dst_stage)

    def _recv_meta(self, src_stage):
        obj = super()._recv_meta(src_stage)
        if isinstance(obj, _BoundaryError):
            raise ValueError(f"PipelineStage {self.stage_index}: stage {src_stage} reports: {obj.message}")
        if isinstance(obj, _MetaWithLayouts):
            if isinstance(obj.meta, _StageForwardMeta) and obj.layouts is not None:
                self._hp_in_layouts = obj.layouts
            return obj.meta
        return obj

    # ------------------------------------------------------------------ per-step statistics
    def _hp_stats(self):
        st = self.__dict__.get("_hp_step_stats")
        if st is None:
            st = self.__dict__["_hp_step_stats"] = dict(sent_messages=0, sent_bytes=0, live_microbatches=0,
                                                        peak_live_microbatches=0, compute_s=0.0)
        return st

    @property
    def step_stats(self) -> dict:
        """This stage's counts for the current (or last) step: ``sent_messages`` / ``sent_bytes`` (boundary
        activations and gradients it sent point to point), ``peak_live_microbatches`` (most microbatches
        whose forward activations it held at once, waiting for their backward) and ``compute_s`` (seconds
        in this stage's forward/backward computations, when ``stage.time_compute = True``: the bubble
        fraction of a rank is ``1 - sum(compute_s of its stages) / step time``)."""
        return dict(self._hp_stats())

    def _hp_count_sends(self, ops):
        st = self._hp_stats()
        for op in ops:
            st["sent_messages"] += 1
            st["sent_bytes"] += op.tensor.numel() * op.tensor.element_size()
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._hp_count_sends(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._hp_count_sends(super().get_bwd_send_ops(bwd_chunk_id))

    # set True to time this stage's compute (step_stats["compute_s"]); on an accelerator each timed
    # call synchronizes the device, so leave it off outside measurements
    time_compute = False

    def _hp_timed(self, func, *args, **kwargs):
        if not self.time_compute:
            return func(*args, **kwargs)
        import time
        sync = torch.cuda.synchronize if torch.device(self.device).type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            sync()
            st = self._hp_stats()
            st["compute_s"] = st.get("compute_s", 0.0) + time.perf_counter() - t0

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, *rest, **extra_kwargs):
        out = self._hp_timed(super().forward_one_chunk, fwd_chunk_id, args, kwargs, *rest, **extra_kwargs)
        st = self._hp_stats()
        st["live_microbatches"] = len(self.fwd_cache)
        st["peak_live_microbatches"] = max(st["peak_live_microbatches"], len(self.fwd_cache))
        return out

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._hp_timed(super().backward_one_chunk, bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._hp_timed(super().backward_weight_one_chunk, bwd_chunk_id, *args, **kwargs)

    def clear_runtime_states(self):
        super().clear_runtime_states()
        self.__dict__["_hp_step_stats"] = None

    # ------------------------------------------------------------------ our FSDPModule
    def _hp_fsdp(self):
        return self.submod if isinstance(self.submod, FSDPModule) else None

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        m = self._hp_fsdp()
        if m is not None:
            # as torch's schedules do for FSDP2: accumulate unsharded gradients over the microbatches,
            # reduce-scatter once, on the last backward of the step
            m.set_is_last_backward(last_backward)
            m.set_requires_gradient_sync(last_backward)
            m.set_reshard_after_backward(last_backward)
        if getattr(self.submod, "_hp_replicated", False):  # replicate(): average once, on the last backward
            set_replicate_gradient_sync(self.submod, last_backward)
        if backward_type != "weight":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        # The zero-bubble weight pass (torch's stage_backward_weight) finds each parameter's gradient
        # accumulator and assigns ``param.grad = dw``. Autograd of our DTensors runs on their local
        # tensors, so dw is the local gradient: hand torch the local tensors (same accumulators), and
        # the gradients land where the DTensor's ``.grad`` view reads them.
        sub = self.submod
        local = [p._local_tensor if isinstance(p, DTensor) else p for p in sub.parameters()]
        object.__setattr__(sub, "parameters", lambda *a, **k: iter(local))
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        finally:
            del sub.__dict__["parameters"]

    def _post_metadata_inference_cleanup(self):
        super()._post_metadata_inference_cleanup()
        for mod in self.submod.modules():
            if isinstance(mod, FSDPModule):
                mod.reshard()
                for p in mod.parameters():
                    p.grad = None


def _lay_desc(dtensor: DTensor):
    """A picklable description of a DTensor's layout (mesh ranks and shape, placements, global shape, dtype)."""
    lay = dtensor._layout
    return dict(mesh_shape=tuple(lay.mesh_shape), alias_names=tuple(lay.alias_names), rank_list=tuple(lay.rank_list),
                placements=tuple(dtensor.placements), shape=tuple(dtensor.shape),
                dtype=str(dtensor.dtype).replace("torch.", ""))


def _lay_from(desc):
    from hyper_parallel.dtensor.layout import Layout
    return Layout(desc["mesh_shape"], desc["alias_names"], desc["rank_list"]).with_placements(
        desc["placements"], len(desc["shape"]))


def _lay_str(desc):
    return (f"DTensor{list(desc['shape'])} {desc['dtype']} on ranks {list(desc['rank_list'])} (mesh "
            f"{list(desc['mesh_shape'])}) placements {desc['placements']}")


class HeteroPipelineStage(PipelineStage):
    """A pipeline stage whose neighbours may live on meshes of other shapes and sizes.

    Stage 0 may run on 4 ranks with TP 4 and stage 1 on 2 ranks with TP 2: the ranks of one stage
    are the ranks of its mesh, every rank runs exactly one stage, and the boundary activation and
    its gradient move as the cross-mesh redistribution's point-to-point messages (the minimal-byte
    plan of ``dtensor/cross_mesh_plan.py``: each element a receiver lacks crosses the wire
    once, all pieces from one rank to another as one message).

    Arguments: torch's ``submodule``, ``stage_index``, ``num_stages``, ``device``, and the example
    boundary DTensors on this stage's own mesh: ``input_args`` (one DTensor; every stage but the
    first) and ``output_args`` (one DTensor; every stage but the last). They fix the boundary
    layouts (torch's STATIC mode: no shape inference); on the first step every rank learns every
    stage's boundary layouts (one ``all_gather_object`` on the world group) and a boundary whose two
    sides disagree in global shape or dtype is an error on every rank, naming both stages.
    """

    def __init__(self, submodule, stage_index: int, num_stages: int, device, input_args=None, output_args=None,
                 dw_builder=None, get_mesh=None):
        import torch.distributed as dist
        where = f"HeteroPipelineStage {stage_index}"
        for arg, v, need in (("input_args", input_args, stage_index > 0),
                             ("output_args", output_args, stage_index < num_stages - 1)):
            if need and not isinstance(v, DTensor):
                raise ValueError(f"{where}: {arg} must be one example DTensor on this stage's mesh (the boundary "
                                 f"layout), got {type(v).__name__}")
            if isinstance(v, DTensor) and v.device_mesh.get_coordinate() is None:
                raise ValueError(f"{where}: {arg} is on {v.device_mesh}, which does not hold this rank "
                                 f"({dist.get_rank()}); a stage's ranks are its mesh's ranks")
            if isinstance(v, DTensor) and v._layout.has_partial():
                raise ValueError(f"{where}: {arg} has a Partial placement {tuple(v.placements)}; a boundary "
                                 "activation must be Shard/Replicate")
        me = dist.get_rank()
        group = _SELF_GROUPS.get(me)
        if group is None:
            group = _SELF_GROUPS[me] = dist.new_group([me], use_local_synchronization=True)
        self._hp_in_desc = _lay_desc(input_args) if stage_index > 0 else None
        self._hp_out_desc = _lay_desc(output_args) if stage_index < num_stages - 1 else None
        super().__init__(submodule, stage_index, num_stages, device,
                         input_args=input_args if stage_index > 0 else None,
                         output_args=output_args if stage_index < num_stages - 1 else None,
                         group=group, dw_builder=dw_builder, get_mesh=get_mesh)
        # the schedule's view: stage i is "pipeline rank" i (the peers are sets of ranks, below)
        self.group_rank, self.group_size = stage_index, num_stages
        self.stage_index_to_group_rank = {i: i for i in range(num_stages)}
        self._hp_progs = None
        self._hp_recv = {}

    def _prepare_forward_infra(self, num_microbatches, args, kwargs=None, has_backward=False):
        if self.is_first and self._user_meta.inputs is None and args is not None:
            # the first stage's inputs come from step(): their metadata is the first microbatch's
            from torch.distributed.pipelining._utils import extract_tensor_metas, validate_and_normalize_to_tuple
            self._user_meta.inputs = extract_tensor_metas(validate_and_normalize_to_tuple(args))
        if self.is_last and self._user_meta.outputs is None:
            # the last stage sends nothing: torch only needs to know it has one output (the loss input)
            self._user_meta.outputs = self._user_meta.inputs[:1]
        return super()._prepare_forward_infra(num_microbatches, args, kwargs, has_backward)

    # every stage gave its boundary layouts: STATIC mode, no vote messages
    def _warmup_forward_vote(self, has_backward, received_acc=None):
        return torch.ones(1, dtype=torch.int32)

    def _warmup_backward_result(self, received_result=None):
        return torch.ones(1, dtype=torch.int32)

    def _hp_static_boundary_check(self):
        import torch.distributed as dist
        from hyper_parallel.dtensor import cross_mesh_plan as cmp
        mine = (self.stage_index, self._hp_in_desc, self._hp_out_desc)
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, mine)
        ins, outs = {}, {}
        for s, i, o in got:
            ins.setdefault(s, i)
            outs.setdefault(s, o)
        missing = [s for s in range(self.num_stages) if s not in ins]
        if missing:
            raise ValueError(f"HeteroPipelineStage {self.stage_index}: no rank runs stage(s) {missing} of "
                             f"{self.num_stages}; every stage needs its ranks (one stage per rank)")
        for k in range(self.num_stages - 1):
            a, b = outs[k], ins[k + 1]
            if a["shape"] != b["shape"] or a["dtype"] != b["dtype"]:
                raise ValueError(f"HeteroPipelineStage {self.stage_index}: the boundary of stages {k} and {k + 1} "
                                 f"disagrees: stage {k} outputs {_lay_str(a)}, stage {k + 1} takes {_lay_str(b)}")
            if set(a["rank_list"]) & set(b["rank_list"]):
                raise ValueError(f"HeteroPipelineStage {self.stage_index}: stages {k} and {k + 1} share ranks "
                                 f"{sorted(set(a['rank_list']) & set(b['rank_list']))}; every rank runs one stage")
        me = dist.get_rank()
        progs = {}
        esz = torch.empty(0, dtype=getattr(torch, (self._hp_out_desc or self._hp_in_desc)["dtype"])).element_size()
        if self._hp_in_desc is not None:  # boundary (stage - 1 -> stage): receive forward, send the gradient back
            d = self._hp_in_desc
            plan = cmp.cross_mesh_plan(_lay_from(outs[self.stage_index - 1]), _lay_from(d), d["shape"], esz)
            progs["in"] = (plan.moves.program(me), plan.backward.program(me))
        if self._hp_out_desc is not None:  # boundary (stage -> stage + 1): send forward, receive the gradient
            d = self._hp_out_desc
            plan = cmp.cross_mesh_plan(_lay_from(d), _lay_from(ins[self.stage_index + 1]), d["shape"], esz)
            progs["out"] = (plan.moves.program(me), plan.backward.program(me))
        self._hp_progs = progs

    # ------------------------------------------------------------------ the boundary as cross-mesh messages
    def _hp_send_ops(self, tensor, prog):
        from hyper_parallel.distributed.p2p import _box
        ops = []
        for peer, pieces in prog.sends:
            parts = [_box(tensor, st, sh).reshape(-1) for st, sh in pieces]
            buf = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
            ops.append(dist_p2p_op("isend", buf, peer))
        return self._hp_count_sends(ops)

    def _hp_recv_ops(self, key, prog, like):
        from hyper_parallel.distributed.p2p import _numel
        bufs, ops = [], []
        for peer, pieces in prog.recvs:
            buf = torch.empty(sum(_numel(sh) for _st, sh in pieces), dtype=like.dtype, device=self.device)
            bufs.append((buf, pieces))
            ops.append(dist_p2p_op("irecv", buf, peer))
        self._hp_recv[key] = bufs
        return ops

    def _hp_assemble(self, key, prog, dtype):
        from hyper_parallel.distributed.p2p import _box, _numel
        out = torch.empty(prog.out_shape, dtype=dtype, device=self.device)
        for buf, pieces in self._hp_recv.pop(key, []):
            pos = 0
            for st, sh in pieces:
                n = _numel(sh)
                _box(out, st, sh).copy_(buf[pos:pos + n].view(sh))
                pos += n
        return out

    def _hp_dtype(self, desc):
        return getattr(torch, desc["dtype"])

    def get_fwd_send_ops(self, fwd_chunk_id):
        if self.is_last:
            return []
        output_tuple, _ = self.fwd_cache[fwd_chunk_id]
        return self._hp_send_ops(output_tuple[0].detach(), self._hp_progs["out"][0])

    def get_fwd_recv_ops(self, fwd_chunk_id):
        if self.is_first:
            return []
        return self._hp_recv_ops(("f", fwd_chunk_id), self._hp_progs["in"][0],
                                 torch.empty(0, dtype=self._hp_dtype(self._hp_in_desc)))

    def _retrieve_recv_activations(self, fwd_chunk_id):
        x = self._hp_assemble(("f", fwd_chunk_id), self._hp_progs["in"][0], self._hp_dtype(self._hp_in_desc))
        return (x.requires_grad_(self.has_backward),)

    def get_bwd_send_ops(self, bwd_chunk_id):
        if not self.has_backward or self.is_first:
            return []
        grads = self.bwd_cache.pop(bwd_chunk_id)
        g = grads[0]
        prog = self._hp_progs["in"][1]
        if g is None:
            g = torch.zeros(prog.in_shape, dtype=self._hp_dtype(self._hp_in_desc), device=self.device)
        return self._hp_send_ops(g.detach(), prog)

    def get_bwd_recv_ops(self, bwd_chunk_id):
        if not self.has_backward or self.is_last:
            return []
        return self._hp_recv_ops(("b", bwd_chunk_id), self._hp_progs["out"][1],
                                 torch.empty(0, dtype=self._hp_dtype(self._hp_out_desc)))

    def _retrieve_recv_grads(self, bwd_chunk_id):
        return (self._hp_assemble(("b", bwd_chunk_id), self._hp_progs["out"][1], self._hp_dtype(self._hp_out_desc)),)


_SELF_GROUPS: dict = {}


def dist_p2p_op(kind, buf, peer):
    import torch.distributed as dist
    return dist.P2POp(dist.isend if kind == "isend" else dist.irecv, buf, peer)
