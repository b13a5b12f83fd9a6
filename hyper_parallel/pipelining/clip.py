"""Gradient clipping over a whole pipeline (the torch mechanics: ``platform/torch/pipelining/clip.py``).

``clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, *,
pp_group=None)`` is ``torch.nn.utils.clip_grad_norm_`` whose norm covers every stage of the
pipeline: each rank norms the gradients of its own stages (FSDP / TP DTensor gradients reduced
over their meshes), the ranks of ``pp_group`` (a ProcessGroup or the 1-D ``mesh["pp"]``) combine
the partial norms with one all_reduce, and every rank scales its gradients by the same
``min(1, max_norm / (total + 1e-6))``. Returns the total norm (a plain 0-d tensor, equal on every
rank). ``pp_group=None`` clips this rank's gradients alone. ``get_total_norm(tensors, ...,
pp_group=)`` is the norm without the clipping.
"""
from hyper_parallel.platform import get_platform

_impl = get_platform().feature("pipelining")

clip_grad_norm_ = _impl.clip_grad_norm_
get_total_norm = _impl.get_total_norm

__all__ = ["clip_grad_norm_", "get_total_norm"]
