"""``torch.distributed.tensor.experimental``, spelled for hyper_parallel.

Mirrors PyTorch's module (see :mod:`hyper_parallel.placement_types`) for what
hyper_parallel has: ``local_map``, ``implicit_replication`` and ``register_sharding``
(PyTorch's decorator, on the :class:`hyper_parallel.DistributedOp` registry), and
``context_parallel`` with ``context_parallel_unshard`` and ``set_rotate_method`` beside it (torch keeps
those two in ``torch.distributed.tensor.experimental._attention``; ``hyper_parallel.experimental._attention``
is the same module path here). Context parallelism: ``docs/context_parallel.md``.
"""
from hyper_parallel.dispatch import local_map
from hyper_parallel.dispatch.modes import implicit_replication
from hyper_parallel.dispatch.rules.registered_sharding import register_sharding
from hyper_parallel.context_parallel import torch_api as _attention
from hyper_parallel.context_parallel.torch_api import context_parallel, context_parallel_unshard, set_rotate_method

import sys as _sys
# torch's private path of the last two, under the public name (``hyper_parallel.experimental`` is an alias of this module)
_sys.modules.setdefault("hyper_parallel.experimental._attention", _attention)

__all__ = ["context_parallel", "context_parallel_unshard", "implicit_replication", "local_map", "register_sharding",
           "set_rotate_method"]
