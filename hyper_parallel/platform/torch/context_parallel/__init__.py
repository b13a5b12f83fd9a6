"""Context-parallel mechanics on torch (a platform feature folder).

What it holds:

* :mod:`.kernels` - block attention on local tensors returning ``(out, lse)``, its exact backward
  from the final ``lse``, the online-softmax merge, dense masks from global positions;
* :mod:`.ring` - :class:`~.ring.RingAttention`, the autograd Function: K/V rotated by
  ``batch_isend_irecv`` (overlapped with compute) or one async all_gather; dK/dV passed around
  the ring back to their owners;
* :mod:`.sdpa` - the ``TorchFunctionMode`` that routes ``F.scaled_dot_product_attention`` calls;
* :mod:`.opaque` - under ``torch.compile`` the routed call is one custom op (``hyper_parallel_cp::sdpa``,
  backward op ``sdpa_backward``), so dynamo never traces the mesh planning or the p2p sends.

The framework-neutral planning and the public API are ``hyper_parallel.context_parallel``; it
reaches this folder by ``get_platform().feature("context_parallel")``. Importing this package
registers :mod:`.api` under that name.
"""
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.torch.context_parallel import api

get_platform().register_feature("context_parallel", api)

__all__ = ["api"]
