"""``torch.distributed.tensor.parallel.loss``, spelled for hyper_parallel (see :mod:`hyper_parallel.parallel`)."""
from hyper_parallel.tensor_parallel.loss import loss_parallel

__all__ = ["loss_parallel"]
