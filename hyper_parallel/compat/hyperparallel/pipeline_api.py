"""HyperParallel's pipeline API on the same machinery as the PyTorch-style one.

``hyper_parallel.core.pipeline_parallel`` re-exports this module. Its classes keep
HyperParallel's constructor arguments and semantics and drive what ``hyper_parallel.pipelining``
drives: a :class:`hyper_parallel.pipelining.PipelineStage` (DTensor boundaries, our
``FSDPModule`` stage modules) and torch's schedule runtime. Nothing here schedules anything.

* :class:`PipelineStage` ``(submodule, stage_index, stage_num, device=None, group=None, ...,
  mesh=None)`` records its arguments; the schedule builds the underlying stage when it knows how
  many stages each rank runs (HyperParallel's ``init(virtual_chunk_num)``), which fixes the
  pipeline group when neither ``group`` nor ``mesh`` is given (rank arithmetic: the pipeline is
  the outermost dim, ``world / pp`` ranks per stage).
* :class:`ScheduleGPipe`, :class:`Schedule1F1B`, :class:`ScheduleInterleaved1F1B` ``(stages,
  micro_batch_num, args_batch_dim=None, kwargs_batch_dim=None, output_concat_dim=None)``:
  ``run(*args, **kwargs)`` splits the inputs into ``micro_batch_num`` microbatches along their
  batch dims, runs forward and backward, and returns - on the rank holding the last stage - the
  last stage's outputs of all microbatches concatenated along ``output_concat_dim`` (default 0;
  scalar losses are stacked into a ``[micro_batch_num]`` tensor); other ranks get ``None``.
  The last stage's output *is* the loss: its gradient is a tensor of ones (a non-scalar output is
  summed), and gradients are not divided by the number of microbatches (sum of the microbatch
  losses; make the last stage return ``loss / micro_batch_num`` for a mean).
* :class:`MetaStep` / :class:`MetaStepType`: ``schedule.exec_order`` lists each pipeline rank's
  actions as MetaSteps (converted from torch's schedule IR, read-only).
* :class:`BatchDimSpec`: the batch dim of one input.
"""
from __future__ import annotations

from enum import Enum, auto

import torch

from hyper_parallel.compat.hyperparallel import pipeline_runtime

__all__ = ["PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "MetaStep",
           "MetaStepType", "BatchDimSpec"]


def _impl():
    """The PyTorch-style pipelining API this module drives (imported late: it imports torch's pipelining)."""
    import hyper_parallel.pipelining as api
    return api


class MetaStepType(Enum):
    """Kinds of pipeline actions (HyperParallel's names)."""
    FWD = auto()
    BWD = auto()
    BWD_INPUT = auto()
    BWD_WEIGHT = auto()
    FWD_RECV = auto()
    FWD_SEND = auto()
    BWD_RECV = auto()
    BWD_SEND = auto()
    OVERLAP_F_B = auto()
    FSDP_UNSHARD = auto()
    FSDP_RESHARD = auto()
    FSDP_REDUCE_GRAD = auto()


# torch's action codes -> MetaStepType
_FROM_TORCH = {"F": MetaStepType.FWD, "B": MetaStepType.BWD, "I": MetaStepType.BWD_INPUT,
               "W": MetaStepType.BWD_WEIGHT, "RECV_F": MetaStepType.FWD_RECV, "SEND_F": MetaStepType.FWD_SEND,
               "RECV_B": MetaStepType.BWD_RECV, "SEND_B": MetaStepType.BWD_SEND,
               "OVERLAP_F_B": MetaStepType.OVERLAP_F_B, "UNSHARD": MetaStepType.FSDP_UNSHARD,
               "RESHARD": MetaStepType.FSDP_RESHARD, "REDUCE_GRAD": MetaStepType.FSDP_REDUCE_GRAD}


class MetaStep:
    """One pipeline action: ``(micro_index, type, stage_index)``; composite steps carry ``sub_steps``."""

    def __init__(self, micro_index, meta_type, stage_index, sub_steps=None):
        if not isinstance(meta_type, MetaStepType):
            raise TypeError(f"MetaStep: meta_type must be a MetaStepType, got {meta_type!r}")
        self._micro_index, self._type, self._stage_index = micro_index, meta_type, stage_index
        self._sub_steps = tuple(sub_steps) if sub_steps else None

    micro_index = property(lambda self: self._micro_index)
    type = property(lambda self: self._type)
    stage_index = property(lambda self: self._stage_index)
    sub_steps = property(lambda self: self._sub_steps)

    def __eq__(self, other):
        if not isinstance(other, MetaStep):
            return NotImplemented
        return (self.type, self.micro_index, self.stage_index, self.sub_steps) == \
            (other.type, other.micro_index, other.stage_index, other.sub_steps)

    def __hash__(self):
        return hash((self.type, self.micro_index, self.stage_index))

    def __repr__(self):
        sub = f", sub_steps={list(self.sub_steps)}" if self.sub_steps else ""
        return f"MetaStep(type={self.type}, micro_index={self.micro_index}, stage_index={self.stage_index}{sub})"

    __str__ = __repr__


class BatchDimSpec:
    """The batch dim of one input (``run`` splits it into microbatches along this dim)."""

    __slots__ = ("batch_dim",)

    def __init__(self, batch_dim):
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int):
            raise TypeError(f"BatchDimSpec: batch_dim must be an int, got {batch_dim!r}")
        self.batch_dim = batch_dim

    def __repr__(self):
        return f"BatchDimSpec({self.batch_dim})"

    def __eq__(self, other):
        return isinstance(other, BatchDimSpec) and other.batch_dim == self.batch_dim

    def __hash__(self):
        return hash(self.batch_dim)

    @staticmethod
    def from_tuple(batch_dims):
        if not isinstance(batch_dims, tuple):
            raise TypeError(f"BatchDimSpec.from_tuple: batch_dims must be a tuple, got {type(batch_dims).__name__}")
        return tuple(BatchDimSpec(d) for d in batch_dims)

    @staticmethod
    def from_dict(batch_dims):
        if not isinstance(batch_dims, dict):
            raise TypeError(f"BatchDimSpec.from_dict: batch_dims must be a dict, got {type(batch_dims).__name__}")
        return {k: BatchDimSpec(v) for k, v in batch_dims.items()}


def _dim(entry, what):
    if entry is None:
        return None
    if isinstance(entry, BatchDimSpec):
        return entry.batch_dim
    if isinstance(entry, int) and not isinstance(entry, bool):
        return entry
    raise TypeError(f"{what}: a batch dim must be an int, a BatchDimSpec or None, got {entry!r}")


def _args_dims(spec, where):
    if spec is None:
        return None
    if isinstance(spec, (int, BatchDimSpec)) and not isinstance(spec, bool):
        spec = (spec,)
    if not isinstance(spec, (list, tuple)):
        raise TypeError(f"{where}: args_batch_dim must be an int, a BatchDimSpec or a list/tuple of them, "
                        f"got {spec!r}")
    return tuple(_dim(e, f"{where}: args_batch_dim") for e in spec)


def _kwargs_dims(spec, where):
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise TypeError(f"{where}: kwargs_batch_dim must be a dict of name -> int | BatchDimSpec, got {spec!r}")
    return {k: _dim(v, f"{where}: kwargs_batch_dim[{k!r}]") for k, v in spec.items()}


class PipelineStage:
    """HyperParallel's pipeline stage.

    Args:
        submodule: this stage's part of the model (parameters may be DTensors; may be a ``fully_shard``
            module). On the last stage its output is the loss.
        stage_index: this stage's index; stage_num: the number of stages of the whole pipeline.
        device: where boundary buffers live (default: the current accelerator, else the CPU).
        group: the pipeline process group; mesh: the 1-D pipeline mesh (``root_mesh["pp"]``), used when
            ``group`` is None. With neither, the pipeline is the outermost dim of the world.
        has_backward: ``False`` for a forward-only stage (the schedule then runs forward only).
        src_stage / dst_stage / dyn_shape / shared_parameters: HyperParallel's, accepted with their
            defaults only (neighbours are stage_index -/+ 1; shapes are fixed after the first step;
            tied parameters across stages are not supported).
    """

    def __init__(self, submodule, stage_index: int, stage_num: int, device=None, group=None, src_stage=None,
                 dst_stage=None, dyn_shape=False, has_backward=True, shared_parameters=None, mesh=None):
        where = "PipelineStage"
        if not isinstance(submodule, torch.nn.Module):
            raise TypeError(f"{where}: submodule must be a module, got {type(submodule).__name__}")
        for arg, v in (("stage_index", stage_index), ("stage_num", stage_num)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{where}: {arg} must be an int, got {v!r}")
        if stage_num < 1 or not 0 <= stage_index < stage_num:
            raise ValueError(f"{where}: stage_index={stage_index} is out of range for stage_num={stage_num}; "
                             "expected 0 <= stage_index < stage_num")
        for arg, v, default in (("src_stage", src_stage, stage_index - 1), ("dst_stage", dst_stage, stage_index + 1)):
            if v is not None and v != default:
                raise ValueError(f"{where}: {arg}={v!r} is not supported; stage {stage_index}'s neighbours are "
                                 f"stages {stage_index - 1} and {stage_index + 1} (leave {arg}=None)")
        if dyn_shape:
            raise ValueError(f"{where}: dyn_shape=True is not supported; boundary shapes are inferred on the first "
                             "step and must stay fixed")
        if shared_parameters is not None:
            raise ValueError(f"{where}: shared_parameters={shared_parameters!r} is not supported; keep tied "
                             "parameters on one stage")
        self.submodule = submodule
        self.stage_index, self.stage_num = stage_index, stage_num
        self.device = device
        self.group, self.mesh = group, mesh
        self.has_backward = bool(has_backward)
        self.stage = None  # the hyper_parallel.pipelining.PipelineStage, built by init()

    @property
    def is_first_stage(self):
        return self.stage_index == 0

    @property
    def is_last_stage(self):
        return self.stage_index == self.stage_num - 1

    def init(self, virtual_chunk_num: int):
        """Build the underlying stage (the schedule calls this with the number of stages per rank)."""
        impl = _impl()
        if self.stage is not None:
            if self._chunks != virtual_chunk_num:
                raise ValueError(f"PipelineStage {self.stage_index}: already used by a schedule with "
                                 f"{self._chunks} stage(s) per rank, now given to one with {virtual_chunk_num}")
            return self.stage
        group, _ = pipeline_runtime.pp_group(self.stage_index, self.stage_num, virtual_chunk_num, self.mesh, self.group,
                                    f"PipelineStage {self.stage_index}")
        device = self.device if self.device is not None else pipeline_runtime.default_device()
        self.stage = impl.PipelineStage(self.submodule, self.stage_index, self.stage_num, device, group=group)
        self._chunks = virtual_chunk_num
        self.device = device
        return self.stage


class _Schedule:
    """Common part of the HyperParallel schedules: build the torch schedule on the stages, ``run``."""

    _single = _multi = None

    def __init__(self, stages, micro_batch_num, args_batch_dim=None, kwargs_batch_dim=None, output_concat_dim=None):
        name = type(self).__name__
        if isinstance(stages, PipelineStage):
            stages = [stages]
        if not isinstance(stages, (list, tuple)) or not stages or \
                not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{name}: stages must be a PipelineStage or a non-empty list of them "
                            "(hyper_parallel.core.pipeline_parallel.PipelineStage), got "
                            f"{stages!r}")
        if isinstance(micro_batch_num, bool) or not isinstance(micro_batch_num, int) or micro_batch_num < 1:
            raise ValueError(f"{name}: micro_batch_num must be a positive int, got {micro_batch_num!r}")
        if output_concat_dim is not None and (isinstance(output_concat_dim, bool)
                                              or not isinstance(output_concat_dim, int)):
            raise ValueError(f"{name}: output_concat_dim must be an int or None, got {output_concat_dim!r}")
        self.stages = sorted(stages, key=lambda s: s.stage_index)
        self.micro_batch_num = micro_batch_num
        self._output_concat_dim = output_concat_dim
        n_local = len(self.stages)
        cls_name = self._single if n_local == 1 else self._multi
        if cls_name is None:
            raise ValueError(f"{name}: got {n_local} stages on this rank ({[s.stage_index for s in self.stages]}); "
                             f"{name} runs one stage per rank (use ScheduleInterleaved1F1B for several)")
        impl = _impl()
        torch_stages = [s.init(n_local) for s in self.stages]
        a, k = pipeline_runtime.chunk_specs(_args_dims(args_batch_dim, name), _kwargs_dims(kwargs_batch_dim, name))
        self._collect = pipeline_runtime.StageOutputs()
        has_backward = all(s.has_backward for s in self.stages)
        cls = impl.get_schedule_class(cls_name)
        first = torch_stages[0] if n_local == 1 and cls_name != "Interleaved1F1B" else torch_stages
        self._schedule = cls(first, n_microbatches=micro_batch_num,
                             loss_fn=self._collect if has_backward else None,
                             args_chunk_spec=a, kwargs_chunk_spec=k, scale_grads=False)
        self._has_backward = has_backward
        self._has_first = any(s.is_first_stage for s in self.stages)
        self._has_last = any(s.is_last_stage for s in self.stages)

    @property
    def schedule(self):
        """The underlying ``hyper_parallel.pipelining`` (torch) schedule."""
        return self._schedule

    @property
    def exec_order(self):
        """Each pipeline rank's actions as lists of :class:`MetaStep` (``None``: an idle slot)."""
        out = {}
        for rank, row in pipeline_runtime.exec_order(self._schedule).items():
            steps = []
            for item in row:
                if item is None:
                    steps.append(None)
                    continue
                s, kind, mb, subs = item
                sub = tuple(MetaStep(m, _FROM_TORCH[k], i) for i, k, m in subs) if subs else None
                steps.append(MetaStep(mb, _FROM_TORCH[kind], s if not sub else None, sub))
            out[rank] = steps
        return out

    def run(self, *args, **kwargs):
        """One training step: forward and backward of every microbatch; the last stage's outputs concatenated."""
        if not self._has_backward:
            outs = self._schedule.eval(*(args if self._has_first else ()), **kwargs)
            return outs if self._has_last else None
        return pipeline_runtime.run(self._schedule, self._collect, self.micro_batch_num, self._has_first, self._has_last,
                           self._output_concat_dim, self.stages[0].device, args, kwargs)


class ScheduleGPipe(_Schedule):
    """All forwards, then all backwards (one stage per rank; several stages per rank run looped BFS)."""
    _single, _multi = "GPipe", "LoopedBFS"


class Schedule1F1B(_Schedule):
    """One forward, one backward in the steady state (one stage per rank; micro_batch_num >= stage_num)."""
    _single = "1F1B"


class ScheduleInterleaved1F1B(_Schedule):
    """Interleaved 1F1B over several stages per rank (looped map: rank r holds r, r + pp, ...)."""
    _single = _multi = "Interleaved1F1B"
