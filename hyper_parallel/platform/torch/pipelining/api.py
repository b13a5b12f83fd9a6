"""What ``get_platform().feature("pipelining")`` returns: the stage, the schedules, ``microbatch``."""
from torch.distributed.pipelining import microbatch

from hyper_parallel.platform.torch.pipelining.schedules import (
    PipelineScheduleMulti, PipelineScheduleSingle, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
    ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble,
    get_schedule_class, schedule_kind)
from hyper_parallel.platform.torch.pipelining import hp
from hyper_parallel.platform.torch.pipelining.stage import HeteroPipelineStage, PipelineStage
from hyper_parallel.platform.torch.pipelining.clip import clip_grad_norm_, get_total_norm  # noqa: E402

__all__ = [
    "PipelineStage", "HeteroPipelineStage", "PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
    "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV", "get_schedule_class", "schedule_kind", "microbatch", "hp",
]
__all__ += ["clip_grad_norm_", "get_total_norm"]
