"""torch's pipeline schedules with hyper_parallel's argument checks in front of them.

Each class here is a subclass of the torch class of the same name that adds nothing but
checks: the schedule runtime, constructor arguments and ``step`` / ``eval`` semantics are
torch's. The checks run on every rank that gets the argument, before the schedule issues any
point-to-point message, and name the argument and its value:

* ``n_microbatches`` a positive int; at least the number of stages for ``Schedule1F1B`` and
  ``ScheduleDualPipeV``;
* ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``: exactly 2 stages per rank;
* the zero-bubble family (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
  ``ScheduleDualPipeV``) refuses stages that contain ``fully_shard`` modules: its separate
  weight-gradient pass (``torch.autograd.grad``) bypasses their post-backward reduce-scatter;
* ``step(..., target=...)`` or ``losses=`` on a schedule built without ``loss_fn``;
* every tensor a rank passes to ``step`` (positional, keyword, ``target``) must split into
  ``n_microbatches`` equal microbatches along its chunk dim (torch would cut an uneven batch
  into uneven microbatches, whose averaged losses are not the whole batch's mean).
"""
from __future__ import annotations

import inspect

import torch
from torch.distributed.pipelining import schedules as _ts
from torch.distributed.pipelining.stage import _PipelineStageBase

from hyper_parallel.fsdp.api import FSDPModule
from hyper_parallel.distributed import collective_guard as _fault

__all__ = ["PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
           "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
           "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "get_schedule_class", "schedule_kind"]

PipelineScheduleSingle = _ts.PipelineScheduleSingle
PipelineScheduleMulti = _ts.PipelineScheduleMulti


def _chunk_dims(spec, num_args):
    """Split dims from a torch chunk spec (a tuple / dict of TensorChunkSpec or None), default 0."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        return {k: getattr(v, "split_dim", 0) for k, v in spec.items()}
    return tuple(getattr(v, "split_dim", 0) for v in spec)


class _Checked:
    """Mixin: argument checks before torch's ``__init__`` and ``step``."""

    _torch_cls = None
    _needs_mb_ge_stages = False
    _stages_per_rank = None
    _split_backward = False  # zero-bubble family: separate input- and weight-gradient passes

    def __init__(self, *args, **kwargs):
        name = type(self).__name__
        bound = inspect.signature(self._torch_cls.__init__).bind(self, *args, **kwargs).arguments
        n = bound.get("n_microbatches")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}: n_microbatches must be a positive int, got {n!r}")
        if "stage" in bound:
            stages = [bound["stage"]]
        else:
            stages = bound.get("stages")
            if not isinstance(stages, (list, tuple)) or not stages:
                raise ValueError(f"{name}: stages must be a non-empty list of this rank's PipelineStages, "
                                 f"got {stages!r}")
            stages = list(stages)
        num_stages = stages[0].num_stages
        if self._needs_mb_ge_stages and n < num_stages:
            raise ValueError(f"{name}: n_microbatches={n} is smaller than the number of stages ({num_stages}); "
                             f"{name} needs n_microbatches >= num_stages")
        if self._stages_per_rank is not None and len(stages) != self._stages_per_rank:
            raise ValueError(f"{name}: stages has {len(stages)} stage(s) on this rank (stage indices "
                             f"{[s.stage_index for s in stages]}); {name} needs exactly "
                             f"{self._stages_per_rank} stages per rank (a V: rank r holds stages r and "
                             f"{2}*pp-1-r)")
        self._hp_check_stage_map(name, stages, num_stages)
        if self._split_backward:
            for st in stages:
                sub = getattr(st, "submod", None)
                if sub is not None and any(isinstance(m, FSDPModule) for m in sub.modules()):
                    raise NotImplementedError(
                        f"{name}: stage {st.stage_index}'s module contains fully_shard (FSDPModule) modules; "
                        f"{name} computes weight gradients in a separate pass (torch.autograd.grad), which "
                        "bypasses fully_shard's post-backward reduce-scatter, so its gradients would be wrong. "
                        "Use ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS with "
                        "fully_shard stages")
        super().__init__(*args, **kwargs)

    def _hp_check_stage_map(self, name, stages, num_stages):
        """The stages' count and indices must fit the pipeline group (the pp mesh dim) and the schedule's map."""
        for st in stages:
            if not isinstance(st, _PipelineStageBase):
                raise ValueError(f"{name}: stages must be PipelineStages, got {type(st).__name__}")
            if st.num_stages != num_stages:
                raise ValueError(f"{name}: stage {st.stage_index} has num_stages={st.num_stages} but stage "
                                 f"{stages[0].stage_index} has num_stages={num_stages}; every stage must agree")
        size, rank = stages[0].group_size, stages[0].group_rank
        mine = [st.stage_index for st in stages]
        if self._stages_per_rank is None and issubclass(self._torch_cls, _ts.PipelineScheduleSingle):
            per_rank, expect = 1, [rank]
        elif self._stages_per_rank == 2:  # V: rank r holds r and 2 pp - 1 - r
            per_rank, expect = 2, sorted([rank, 2 * size - 1 - rank])
        else:  # looped: rank r holds r, r + pp, ...
            per_rank, expect = len(stages), [rank + i * size for i in range(len(stages))]
        if num_stages != size * per_rank:
            raise ValueError(f"{name}: num_stages={num_stages} does not match the pipeline group of {size} ranks "
                             f"with {per_rank} stage(s) per rank; expected num_stages == {size * per_rank} "
                             "(build the stages with num_stages = pp mesh size x stages per rank)")
        if sorted(mine) != expect:
            raise ValueError(f"{name}: this rank (rank {rank} of the pipeline group) holds stage indices {mine}, "
                             f"but {name}'s stage-to-rank map puts stages {expect} on it")

    def step(self, *args, target=None, losses=None, **kwargs):
        name = type(self).__name__
        if self._loss_fn is None and (target is not None or losses is not None):
            given = "target=" if target is not None else "losses="
            raise ValueError(f"{name}.step: {given} was given but the schedule was built with loss_fn=None; "
                             f"a training step needs loss_fn (pass loss_fn= to {name}(...)), "
                             "a forward-only step takes neither target nor losses")
        self._check_batch(args, kwargs, target)
        try:
            return super().step(*args, target=target, losses=losses, **kwargs)
        except RuntimeError as exc:  # torch's stage p2p: name it (a dead neighbour stage, a timeout)
            if not _fault.is_comm_error(exc):
                raise
            _fault.fail(f"pipeline p2p in {name}.step (a send/recv between neighbouring stages)", None, exc)

    def _check_batch(self, args, kwargs, target):
        n = self._n_microbatches
        kw_spec = {k: v for k, v in kwargs.items() if k not in ("return_outputs", "loss_kwargs")}
        adims = _chunk_dims(self._args_chunk_spec, n) or (0,) * len(args)
        kdims = _chunk_dims(self._kwargs_chunk_spec, n) or {}
        items = [(f"args[{i}]", a, adims[i] if i < len(adims) else 0) for i, a in enumerate(args)]
        items += [(f"kwargs[{k!r}]", v, kdims.get(k, 0)) for k, v in kw_spec.items()]
        items.append(("target", target, 0))
        for what, t, d in items:
            if d is None or not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue
            size = t.shape[d]
            if size % n:
                raise ValueError(f"{type(self).__name__}.step: {what} has size {size} along its chunk dim {d}, "
                                 f"which does not split into n_microbatches={n} equal microbatches; "
                                 f"expected a multiple of {n}")


def _checked(torch_cls, **flags):
    cls = type(torch_cls.__name__, (_Checked, torch_cls), {"_torch_cls": torch_cls, **flags,
                                                             "__module__": __name__,
                                                             "__doc__": torch_cls.__doc__})
    return cls


ScheduleGPipe = _checked(_ts.ScheduleGPipe)
Schedule1F1B = _checked(_ts.Schedule1F1B, _needs_mb_ge_stages=True)
ScheduleInterleaved1F1B = _checked(_ts.ScheduleInterleaved1F1B)
ScheduleLoopedBFS = _checked(_ts.ScheduleLoopedBFS)
ScheduleInterleavedZeroBubble = _checked(_ts.ScheduleInterleavedZeroBubble, _split_backward=True)
ScheduleZBVZeroBubble = _checked(_ts.ScheduleZBVZeroBubble, _stages_per_rank=2, _split_backward=True)
ScheduleDualPipeV = _checked(_ts.ScheduleDualPipeV, _stages_per_rank=2, _needs_mb_ge_stages=True,
                             _split_backward=True)

_OURS = {c._torch_cls: c for c in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
                                   ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)}


def get_schedule_class(schedule_name: str):
    """torch's ``get_schedule_class`` (case-insensitive name), answering the checked class where there is one."""
    if not isinstance(schedule_name, str):
        raise ValueError(f"get_schedule_class: schedule_name must be a str, got {schedule_name!r}")
    cls = _ts.get_schedule_class(schedule_name)
    return _OURS.get(cls, cls)


def schedule_kind(schedule) -> tuple:
    """``(kind, stages_per_rank)`` of a schedule class or name: ``("single", 1)``, ``("looped", None)``
    or ``("v", 2)`` (ZBV, DualPipeV)."""
    cls = get_schedule_class(schedule) if isinstance(schedule, str) else schedule
    if not (isinstance(cls, type) and issubclass(cls, _ts._PipelineSchedule)):
        raise ValueError(f"schedule must be a pipeline schedule class or its name (e.g. '1F1B', "
                         f"'Interleaved1F1B'), got {schedule!r}")
    if issubclass(cls, (_ts.ScheduleZBVZeroBubble, _ts.ScheduleDualPipeV)):
        return "v", 2
    if issubclass(cls, _ts.PipelineScheduleSingle):
        return "single", 1
    return "looped", None
