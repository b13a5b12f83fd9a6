"""``torch.distributed.tensor.parallel``, spelled for hyper_parallel.

Mirrors PyTorch's module layout so that a mechanical swap of the
``torch.distributed.tensor`` prefix for ``hyper_parallel`` works
(``from hyper_parallel.parallel import ColwiseParallel, parallelize_module``).
The implementations live in :mod:`hyper_parallel.tensor_parallel`.
"""
from hyper_parallel.tensor_parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
    RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module)

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput",
           "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel", "parallelize_module", "loss_parallel"]
