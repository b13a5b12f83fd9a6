"""``torch.distributed.tensor.parallel.style``, spelled for hyper_parallel (see :mod:`hyper_parallel.parallel`)."""
from hyper_parallel.tensor_parallel.style import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
    RowwiseParallel, SequenceParallel)

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput",
           "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel"]
