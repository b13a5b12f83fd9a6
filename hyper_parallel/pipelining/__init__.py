"""Pipeline parallelism: PyTorch's ``torch.distributed.pipelining`` API on hyper_parallel's DTensor.

Design (one screen)
-------------------
* **One scheduler: torch's.** The schedules (``ScheduleGPipe``, ``Schedule1F1B``,
  ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``,
  ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) are subclasses of torch's classes that only
  add argument checks (errors naming the argument and value, raised before any message is sent);
  ``get_schedule_class`` answers them, ``microbatch`` is torch's module. Constructor arguments and
  ``step(*args, target=, losses=, return_outputs=)`` / ``eval()`` are torch 2.13's.
* **The value is in the stage.** :class:`PipelineStage` has torch 2.13's signature and is a
  subclass of torch's stage. Boundary DTensors travel as their local tensors; their layouts go
  once, with the metadata torch exchanges on the first step, and the receiving stage rebuilds
  them on its own mesh. Gradients need no layout: autograd runs on local tensors in this
  library, so the local gradient torch sends back is the DTensor's gradient. Stage modules that
  are our ``FSDPModule`` accumulate unsharded gradients over the microbatches and reduce-scatter
  once per step, as torch's schedules arrange for FSDP2.
* **Splitting keeps names.** :func:`split_into_stages` copies the model per local stage and
  deletes what the stage does not own, so every parameter keeps its fully qualified name and
  the union of the stages' ``state_dict()`` is the whole model's (checkpoints reshard across
  pipeline degrees through the usual DCP path).
* **Heterogeneous stages.** :class:`HeteroPipelineStage` lets neighbouring stages live on meshes
  of different shapes and sizes; its boundary moves as the cross-mesh redistribution's
  minimal-byte point-to-point messages, inside the same torch runtime.
* **HyperParallel's API** (``hyper_parallel.core.pipeline_parallel``, whose code lives in
  ``compat/hyperparallel/pipeline_api.py`` and ``pipeline_runtime.py``): its ``PipelineStage`` / ``ScheduleGPipe`` / ``Schedule1F1B`` /
  ``ScheduleInterleaved1F1B(...).run`` build the same stage and torch schedule, with
  HyperParallel's semantics (the last stage returns the loss; ``run`` returns the outputs).
* **Clipping over the pipeline.** :func:`clip_grad_norm_` (``pipelining/clip.py``) is torch's
  ``clip_grad_norm_`` whose norm covers every stage: per-rank norms (DTensor gradients reduced on
  their own meshes) combined over ``pp_group`` with one all_reduce.
* **Files.** ``split.py``: stage splitting (FQNs kept); ``stage.py``: the stage on torch's runtime
  (DTensor boundaries, FSDP stage modules); ``schedules.py``: torch's schedules with argument checks;
  ``clip.py``: the pipeline-wide ``clip_grad_norm_``. Imports: the ground floor, ``dtensor``, ``dispatch`` and the
  ``FSDPModule`` class of ``fsdp`` (a stage recognises a fully_shard'ed module).

Status and what is left: ``docs/pipelining.md``.
"""
from hyper_parallel.pipelining.split import (balanced_stage_layers, plan_stages, split_into_stages,
                                             stage_ids_on_rank, stage_module, stage_weights)
from hyper_parallel.pipelining.clip import clip_grad_norm_, get_total_norm
from hyper_parallel.pipelining.stage import HeteroPipelineStage, PipelineStage
from hyper_parallel.pipelining.schedules import (
    PipelineScheduleMulti, PipelineScheduleSingle, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
    ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble,
    get_schedule_class)
from torch.distributed.pipelining import microbatch

__all__ = [
    "PipelineStage", "HeteroPipelineStage", "PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
    "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV", "get_schedule_class", "microbatch", "split_into_stages", "plan_stages", "balanced_stage_layers", "stage_weights", "stage_module",
    "stage_ids_on_rank",
]
__all__ += ["clip_grad_norm_", "get_total_norm"]
