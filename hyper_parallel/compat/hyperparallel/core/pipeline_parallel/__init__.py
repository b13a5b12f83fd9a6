"""HyperParallel's pipeline API: ``hyper_parallel.core.pipeline_parallel``.

A facade (the top layer of the import contracts, like ``hyper_parallel.fsdp``): the classes
live in ``hyper_parallel/compat/hyperparallel/pipeline_api.py`` and run on the same stage and schedule
runtime as the PyTorch-style ``hyper_parallel.pipelining``. Semantics and limits:
``docs/pipelining.md`` ("HyperParallel's API").
"""
from hyper_parallel.compat.hyperparallel.pipeline_api import (BatchDimSpec, MetaStep, MetaStepType, PipelineStage, Schedule1F1B,
                                              ScheduleGPipe, ScheduleInterleaved1F1B)

__all__ = ["PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "MetaStep", "MetaStepType",
           "BatchDimSpec"]
