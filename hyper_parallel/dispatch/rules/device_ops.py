"""Moving DTensors between devices and reading them out: ``cpu``, ``cuda``, ``to_dense``, ``type``, ``numpy``.

* ``cpu()`` / ``cuda()`` / ``to_dense()``: the local tensor moves, the layout is kept
  (Partial too: moving every piece moves their sum); differentiable as on a plain
  tensor (the gradient comes back on the original device). On a build without CUDA,
  ``cuda()`` raises the framework's own error.
* ``type()`` with no dtype answers the type string (``'torch.DoubleTensor'``);
  ``type(dtype)`` / ``type('torch.FloatTensor')`` is a cast (the elementwise family's
  rule: layout kept, Partial reduced first for integer/bool targets).
* ``type_as(other)``: ``to(other.dtype)`` (``other`` may be a plain tensor of any
  shape: only its dtype is read).
* ``numpy()``: on PyTorch's meshes the DTensor's value, the whole tensor, on every rank
  (collective, as ``tolist()`` and ``item()``); on HyperParallel's meshes
  (``semantics_of(mesh).numpy_reads_local_piece``) this rank's local piece, as HyperParallel's storage-backed
  DTensor gives it (no communication; ``np.allclose(ref_slice, dt.cpu().detach().numpy())``
  in its programs). The framework refuses it for a tensor that requires grad, as for a
  plain tensor (``.detach().numpy()``). ``__array__`` (``np.asarray(dt)``) is the same.
"""
from __future__ import annotations

from hyper_parallel.dtensor.mesh_semantics import semantics_of
from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, register_decomposition
from hyper_parallel.dispatch.rules.base import is_dtensor as _is_dt
from hyper_parallel.dispatch.rules.elementwise import NONLINEAR, UNARY_LINEAR, ElementwiseOp, elementwise_strategy
import torch

DEVICE_MOVES = ("cpu", "cuda", "to_dense", "share_memory_")


class CastRule(ElementwiseOp):
    """``to`` / ``type``: the elementwise cast rule, with the output shape given (the input's).

    The meta device cannot run every cast (``to('cpu')``, ``type('torch.FloatTensor')``),
    and the fallback of deriving the global shape from even shards is wrong for uneven ones.
    """

    def strategy(self, call):
        st = super().strategy(call)
        if st.out_shapes is None and _is_dt(call.args[0]) if call.args else False:
            st.out_shapes = torch.Size(call.shapes[0])
        return st


class TypeRule(CastRule):
    """``Tensor.type``: without a dtype a string (nothing moves), with one a cast."""

    def strategy(self, call):
        if len(call.args) < 2 and call.kwargs.get("dtype") is None:
            return Strategy(call.layouts, None)   # the local tensor's type string
        target = call.args[1] if len(call.args) > 1 else call.kwargs.get("dtype")
        if isinstance(target, str):  # 'torch.FloatTensor': floating targets are linear in Partial pieces
            linear = any(k in target for k in ("Float", "Double", "Half", "Complex"))
            st = elementwise_strategy(call, UNARY_LINEAR if linear else NONLINEAR)
            st.out_shapes = torch.Size(call.shapes[0])
            return st
        return super().strategy(call)


class NumpyRule(DistributedOp):
    """``Tensor.numpy``: the whole tensor (Partial reduced, shards gathered), converted on every rank.

    On HyperParallel's meshes the local piece instead (HyperParallel's DTensor is backed by
    the local tensor's storage, so its ``numpy()`` reads the piece).
    """

    float_args_matter = False

    def strategy(self, call):
        if len(call.layouts) != 1:
            raise NotImplementedError(f"{call.name}: expected one DTensor argument")
        if semantics_of(call.mesh).numpy_reads_local_piece:
            return Strategy([None], None)   # the local piece, as it is
        return Strategy([call.layouts[0].replicated()], None)


def _type_as(self, other):
    """``a.type_as(b)`` is ``a.to(b.dtype)``: only ``b``'s dtype is read, so a plain ``b`` is never data."""
    return self.to(other.dtype)


def register_all():
    for n in DEVICE_MOVES:
        ElementwiseOp(n, UNARY_LINEAR)
    CastRule("to", UNARY_LINEAR)
    TypeRule("type", UNARY_LINEAR)
    NumpyRule("numpy")
    NumpyRule("__array__")   # np.asarray(dt), np.allclose(ref, dt): numpy() under another name
    register_decomposition(torch.Tensor.type_as, _type_as)


__all__ = ["register_all", "DEVICE_MOVES"]
