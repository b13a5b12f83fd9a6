"""``torch.distributed.tensor.parallel.api``, spelled for hyper_parallel (see :mod:`hyper_parallel.parallel`)."""
from hyper_parallel.tensor_parallel.api import parallelize_module

__all__ = ["parallelize_module"]
