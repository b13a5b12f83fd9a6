"""Tensor/sequence parallel styles, parallelize_module, loss_parallel and data-parallel replication."""
from hyper_parallel.core.tensor_parallel.style import (
    ParallelStyle, ColwiseParallel, RowwiseParallel, SequenceParallel, NoParallel,
    PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)
from hyper_parallel.core.tensor_parallel.api import parallelize_module
from hyper_parallel.core.tensor_parallel.loss import loss_parallel
from hyper_parallel.core.tensor_parallel.data_parallel import replicate, data_parallel
