"""Ops that take explicit global strides: ``as_strided`` and ``new_empty_strided``.

A DTensor's stride is its global stride (PyTorch semantics), so ``as_strided`` is
only meaningful where it names a view that sharding can express: the identity
(``x.as_strided(x.size(), x.stride())``) and a permutation of the dims with their
strides (what ``x.permute(...)`` would report). Those run as a view / ``permute``
of the local shard; any other size/stride/offset raises, naming the call.
``new_empty_strided`` makes a fresh tensor: laid out like the input when the
size is the input's, replicated otherwise (as PyTorch chooses).
"""
from __future__ import annotations

from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, bind_args
import torch


def _find_perm(shape, stride, size, new_stride):
    """``perm`` with ``size[i] == shape[perm[i]]`` and ``new_stride[i] == stride[perm[i]]``, or None."""
    if len(size) != len(shape) or len(new_stride) != len(shape):
        return None
    used, perm = set(), []
    for s, st in zip(size, new_stride):
        j = next((j for j in range(len(shape)) if j not in used and shape[j] == s and stride[j] == st), None)
        if j is None:
            return None
        used.add(j)
        perm.append(j)
    return perm


class AsStridedRule(DistributedOp):
    float_args_matter = False

    def strategy(self, call):
        x = call.dtensor_args[0]
        lay, shape = call.layouts[0], call.shapes[0]
        b = bind_args(call.args, call.kwargs, ("input", "size", "stride", "storage_offset"))
        size, new_stride = tuple(b.get("size", ())), tuple(b.get("stride", ()))
        offset = b.get("storage_offset") or 0
        perm = _find_perm(shape, tuple(x.stride()), size, new_stride) if offset == 0 else None
        if perm is None:
            # NotImplementedError is a RuntimeError (PyTorch raises RuntimeError("as_strided not supported
            # with DTensor")); the message starts with PyTorch's words
            raise NotImplementedError(
                f"as_strided not supported with DTensor for size={list(size)}, stride={list(new_stride)}, "
                f"storage_offset={offset}: that is neither the identity nor a permutation of the tensor's global "
                f"size {list(shape)} and stride {list(x.stride())} (placements {list(lay.placements)}); only "
                "those are supported - use view/permute/narrow, or call it on dtensor.full_tensor()")
        if perm == list(range(len(shape))):
            return Strategy([lay], lay, local_fn=lambda t, *a, **k: t.view(t.shape),
                            out_shapes=torch.Size(shape))
        dm = [lay.dim_map[p] for p in perm]
        return Strategy([lay], lay.with_dim_map(dm, lay.partial), local_fn=lambda t, *a, **k: t.permute(perm),
                        out_shapes=torch.Size(size))


class NewEmptyStridedRule(DistributedOp):
    float_args_matter = False

    def strategy(self, call):
        lay, shape = call.layouts[0], call.shapes[0]
        b = bind_args(call.args, call.kwargs, ("input", "size", "stride"))
        size = tuple(b["size"])
        kw = {k: v for k, v in call.kwargs.items() if k != "size" and k != "stride"}
        if size == tuple(shape):
            out = lay.without_partial()
        else:
            out = lay.replicated(len(size))
        lshape = out.local_shape(size, coord=call.mesh.get_coordinate())

        def local_fn(local, *args, **kwargs):
            # a fresh contiguous local buffer: the global stride lives on the wrapper
            return local.new_empty(lshape, **kw)
        return Strategy([lay], out, local_fn=local_fn, out_shapes=torch.Size(size))


def register_all():
    AsStridedRule("as_strided")
    NewEmptyStridedRule("new_empty_strided")
