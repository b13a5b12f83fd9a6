"""Tensor methods and functions whose DTensor meaning is not an op on local tensors.

``detach``, ``requires_grad_``, ``backward``, ``retain_grad``, ``register_hook``,
``item``, ``tolist``, ``len``, printing, the pickling guard, ``torch.autograd.grad`` /
``backward`` and ``nn.Module._apply``'s shallow-copy check. ``DTensor.__torch_function__``
and the dispatcher look them up (``dtensor.SPECIAL_METHODS``) before any sharding rule.
The table is built by :func:`build_table` from ``dtensor.py`` once the class exists
(the class is injected, so this module does not import ``dtensor.py``); other layers
add entries through ``dtensor.register_special`` (e.g. ``loss_parallel``).
"""
from __future__ import annotations

from hyper_parallel.dtensor.mesh_semantics import semantics_of
from hyper_parallel.dtensor.grad_state import _DG, _grad_layout, _set_partial_grad
from hyper_parallel.dtensor.partial_grad_seed import seed_partial_pieces
import torch

_Tensor = torch.Tensor
DTensor = None  # the DTensor class, set by build_table


def _detach(self):
    return DTensor._wrap(self._local_tensor.detach(), self._mesh, self._layout, self._gshape)


def _requires_grad_(self, requires_grad=True):
    self._local_tensor.requires_grad_(requires_grad)
    _DG.mark_dtensor_leaf(self._local_tensor)
    return self


def _backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    if gradient is not None:
        if isinstance(gradient, _Tensor) and not isinstance(gradient, DTensor):
            # a plain tensor (HyperParallel's ``loss.backward(torch.tensor(1.0 / n))``): the whole
            # gradient, the same on every rank, i.e. a replicated one
            if tuple(gradient.shape) != tuple(self._gshape):
                raise ValueError(f"DTensor.backward: plain gradient of shape {tuple(gradient.shape)} does not match "
                                 f"the global shape {tuple(self._gshape)}")
            gradient = semantics_of(self._mesh).plain_backward_gradient(self, gradient)  # HyperParallel's: shares
            gradient = DTensor._wrap(gradient, self._mesh, self._layout.replicated(), self._gshape)
        if not isinstance(gradient, DTensor):
            raise TypeError(f"DTensor.backward: gradient must be a DTensor, got {type(gradient).__name__}")
        local = self._local_tensor
        if (gradient._layout == self._layout and self._layout.has_partial() and local.is_leaf
                and local.requires_grad and inputs is None and not create_graph
                and (local.grad is None or self.__dict__.get("_hp_partial_grad"))):
            # a Partial leaf given a gradient of its own layout keeps it as is (PyTorch: no
            # collective, ``.grad`` is that Partial); see _set_partial_grad
            _set_partial_grad(self, gradient._local_tensor.detach())
            return
        want = _grad_layout(self._layout)
        if gradient._layout != want:
            if inputs is None and not create_graph and gradient._layout.has_partial():
                if seed_partial_pieces(self, gradient, want, retain_graph):
                    return
            gradient = gradient.redistribute(self._mesh, want)
        gradient = gradient._local_tensor
    elif self.numel() != 1:
        raise RuntimeError(f"DTensor.backward: grad can be implicitly created only for scalar outputs "
                           f"(shape {tuple(self._gshape)}); pass gradient=")
    if inputs is not None:
        inputs = [i._local_tensor if isinstance(i, DTensor) else i for i in inputs]
    self._local_tensor.backward(gradient, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)


def _as_list(tensors):
    return [tensors] if isinstance(tensors, _Tensor) else list(tensors)


def _grad_outputs(outputs, grads, what):
    """Local outputs and their local upstream gradients for a backward over (possibly DTensor) outputs."""
    outs = _as_list(outputs)
    grads = [None] * len(outs) if grads is None else _as_list(grads)
    if len(grads) != len(outs):
        raise ValueError(f"{what}: got {len(grads)} gradients for {len(outs)} outputs")
    louts, lgrads = [], []
    for i, (o, g) in enumerate(zip(outs, grads)):
        if isinstance(o, DTensor):
            if g is None and o.numel() != 1:
                raise RuntimeError(f"{what}: grad can be implicitly created only for scalar outputs; output {i} "
                                   f"is a DTensor of global shape {tuple(o._gshape)}: pass its gradient")
            if g is not None:
                if not isinstance(g, DTensor):
                    raise TypeError(f"{what}: the gradient of DTensor output {i} must be a DTensor, "
                                    f"got {type(g).__name__}")
                want = _grad_layout(o._layout)
                g = (g if g._layout == want else g.redistribute(o._mesh, want))._local_tensor
            o = o._local_tensor
        elif isinstance(g, DTensor):
            raise TypeError(f"{what}: output {i} is a plain tensor but its gradient is a DTensor")
        louts.append(o)
        lgrads.append(g)
    return louts, lgrads


def _autograd_grad(outputs, inputs, grad_outputs=None, **kwargs):
    """``torch.autograd.grad`` over DTensors: runs on local tensors; DTensor inputs get DTensor gradients."""
    louts, lgrads = _grad_outputs(outputs, grad_outputs, "torch.autograd.grad")
    ins = _as_list(inputs)
    lins = [i._local_tensor if isinstance(i, DTensor) else i for i in ins]
    res = torch.autograd.grad(louts, lins, lgrads, **kwargs)
    return tuple(DTensor._wrap(g, i._mesh, _grad_layout(i._layout), i._gshape)
                 if g is not None and isinstance(i, DTensor) else g for g, i in zip(res, ins))


def _autograd_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None,
                       inputs=None):
    """``torch.autograd.backward`` over DTensors (see :func:`_autograd_grad`)."""
    louts, lgrads = _grad_outputs(tensors, grad_tensors if grad_tensors is not None else grad_variables,
                                  "torch.autograd.backward")
    if inputs is not None:
        inputs = [i._local_tensor if isinstance(i, DTensor) else i for i in _as_list(inputs)]
    torch.autograd.backward(louts, lgrads, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)


def _retain_grad(self):
    self._local_tensor.retain_grad()


def _register_hook(self, hook):
    mesh, layout, shape = self._mesh, _grad_layout(self._layout), self._gshape

    def local_hook(grad):
        out = hook(DTensor._wrap(grad, mesh, layout, shape))
        if out is None:
            return None
        return out._local_tensor if isinstance(out, DTensor) else out
    return self._local_tensor.register_hook(local_hook)


def _item(self):
    if self._layout.is_replicated():
        return self._local_tensor.item()
    return self.full_tensor().item()


def _tolist(self):
    return self.full_tensor().tolist()


def _len(self):
    if not self._gshape:
        raise TypeError("len() of a 0-d tensor")
    return self._gshape[0]


def _setstate(self, state):
    raise TypeError("DTensor cannot be unpickled")


def _compatible_shallow_copy(dst, src):
    if isinstance(dst, DTensor) and isinstance(src, DTensor):
        # the local tensors decide: a meta local cannot take a CPU local by ``.data =``, so
        # ``module.to_empty(device=...)`` replaces such a parameter (as for plain tensors)
        return torch._has_compatible_shallow_copy_type(dst._local_tensor, src._local_tensor)
    if isinstance(dst, DTensor) or isinstance(src, DTensor):
        return False  # a DTensor and a plain tensor: ``.data =`` would mix the two kinds
    return torch._has_compatible_shallow_copy_type(dst, src)


def build_table(dtensor_cls) -> dict:
    """The special-method table for ``dtensor_cls`` (the DTensor class, injected: this module
    does not import ``dtensor.py``, which calls this once when the class exists)."""
    global DTensor
    DTensor = dtensor_cls
    T = torch.Tensor
    table = {
        T.detach: _detach,
        T.requires_grad_: _requires_grad_,
        T.backward: _backward,
        T.retain_grad: _retain_grad,
        T.register_hook: _register_hook,
        T.item: _item,
        T.tolist: _tolist,
        T.__len__: _len,
        T.__repr__: lambda self, *a, **k: repr(self),
        T.__format__: lambda self, spec: repr(self),
        T.__setstate__: _setstate,
        torch.autograd.grad: _autograd_grad,
        torch.autograd.backward: _autograd_backward,
        # nn.Module._apply (module.to(dtype/device), .double()...) asks whether ``param.data =``
        # may take the converted value; two DTensors always can (see the ``data`` setter)
        torch._has_compatible_shallow_copy_type: _compatible_shallow_copy,
    }
    return table
