"""Tensor/sequence parallel styles, parallelize_module and loss_parallel."""
from hyper_parallel.tensor_parallel.style import (
    ParallelStyle, ColwiseParallel, RowwiseParallel, SequenceParallel, NoParallel,
    PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)
from hyper_parallel.tensor_parallel.api import parallelize_module
from hyper_parallel.tensor_parallel.loss import loss_parallel
