"""DFunction: custom autograd functions that also work on DTensors.

Subclasses write ``forward``/``backward`` as static methods on *local* tensors
(exactly like ``torch.autograd.Function``) and set ``_op_name`` to the name of a
registered :class:`~hyper_parallel.dispatch.rules.base.DistributedOp`:

* called with plain tensors, ``apply`` is the ordinary autograd path;
* called with DTensors, the dispatcher asks the ``DistributedOp`` for the output
  layout (and any input redistribution), runs the function on the local
  tensors and wraps the results as DTensors;
* DTensor inputs without ``_op_name`` raise ``ValueError`` naming the class.

Non-tensor positional arguments are passed through unchanged.

Example::

    class MyAddRule(DistributedOp):
        def infer_layout(self, layouts, extra_args=None):
            return layouts[0]
    MyAddRule("MyAdd")

    class MyAdd(DFunction):
        _op_name = "MyAdd"

        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            return g, g
"""
from __future__ import annotations

from typing import Any, Optional

from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.dispatch.dispatcher import dispatch as _dispatch
import torch



class _LocalCallable:
    """A callable named after the op, so the dispatcher finds the op's rule by name."""

    def __init__(self, func, op_name: str):
        self._fn = func
        self.__name__ = op_name
        self.name = op_name

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


class DFunction(torch.autograd.Function):
    """Base class for user-defined distributed autograd functions (see module docstring)."""

    _op_name: Optional[str] = None

    @staticmethod
    def forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("DFunction subclasses must implement forward()")

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        raise NotImplementedError("DFunction subclasses must implement backward()")

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, DTensor) for a in args) or any(isinstance(v, DTensor) for v in kwargs.values()):
            if cls._op_name is None:
                raise ValueError(
                    f"{cls.__name__} received DTensor inputs but '_op_name' is not set. Set '_op_name' on the "
                    "subclass and register a matching DistributedOp (e.g. MyRule('MyOp')).")
            return _dispatch(cls._local_callable(), args, kwargs)
        return super().apply(*args, **kwargs)

    @classmethod
    def _local_callable(cls) -> _LocalCallable:
        lc = cls.__dict__.get("_hp_local_callable")
        if lc is None or lc.__name__ != cls._op_name:
            def _local(*args, **kwargs):
                # local tensors only here: the ordinary autograd path of this class
                return torch.autograd.Function.apply.__func__(cls, *args, **kwargs)
            lc = _LocalCallable(_local, str(cls._op_name))
            cls._hp_local_callable = lc  # type: ignore[attr-defined]
        return lc
