"""Parallel styles: how one module is sharded over a 1-D mesh (PyTorch's contract).

A style distributes the module's parameters and installs forward hooks that
convert inputs/outputs between plain tensors and DTensors:

* ``ColwiseParallel``: Linear weight/bias ``Shard(0)`` (output features), Embedding
  weight ``Shard(1)``; input replicated, output ``Shard(-1)``.
* ``RowwiseParallel``: Linear weight ``Shard(1)``, bias replicated (added once);
  Embedding weight ``Shard(0)`` (vocab rows, masked lookup); output partial,
  reduced to ``Replicate`` (or reduce-scattered to ``Shard(d)``).
* ``SequenceParallel``: ``nn.LayerNorm`` / ``nn.RMSNorm`` / ``nn.Dropout`` (and module
  classes registered with :meth:`SequenceParallel.register_module_type`) on
  sequence-sharded activations; parameters replicated.
* ``PrepareModuleInput`` / ``PrepareModuleOutput`` / ``PrepareModuleInputOutput``:
  only redistribute inputs/outputs; ``None`` entries are left unchanged.
* ``NoParallel``: parameters replicated, inputs/outputs converted.

``use_local_output=True`` hands plain local tensors to the next module, which
is how torchtitan-style plans keep the model code unchanged.

Constructor arguments are validated when the style is built (``TypeError`` /
``ValueError`` naming the argument, the value and what was expected); errors
found when a style is applied or run name the module type and, under
:func:`parallelize_module`, its fully qualified path in the model.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Dict, List, Optional, Sequence, Tuple, Type, TypeVar, Union

from hyper_parallel.dtensor.api import distribute_tensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh, resolve_mesh
from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.dtensor.placement_types import Placement, Replicate, Shard
import torch

nn = torch.nn

#: per positional input (or output): the placement it has, None to leave it alone; one placement for all
LayoutsArg = Union[Placement, Sequence[Optional[Placement]], None]
#: per keyword input: the placement it has, None to leave it alone
KwargLayoutsArg = Optional[Dict[str, Optional[Placement]]]
_ModuleType = TypeVar("_ModuleType", bound=Type[nn.Module])

# ----------------------------------------------------------------------------- module paths for messages
# parallelize_module sets the fully qualified name of the module a style is being
# applied to; styles capture it at apply time so that errors raised then (unsupported
# module type) or later in the forward hooks name the module's place in the model.
_PATH_STACK: List[str] = []


@contextlib.contextmanager
def _module_path(fqn: str):
    _PATH_STACK.append(fqn)
    try:
        yield
    finally:
        _PATH_STACK.pop()


def _where(module) -> str:
    """``"BatchNorm1d at 'layers.0.norm'"`` (the path is known under parallelize_module)."""
    name = type(module).__name__
    if not _PATH_STACK:
        return name
    fqn = _PATH_STACK[-1]
    return f"{name} at '{fqn}'" if fqn else f"{name} (the root module given to parallelize_module)"


# ----------------------------------------------------------------------------- argument validation
_PLACEMENT_HELP = "a Placement (Shard(d), Replicate() or Partial())"


def _check_bool(style: str, arg: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{style}: {arg} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _check_layout(style: str, arg: str, value) -> Optional[Placement]:
    """One placement for a 1-D mesh, or None."""
    if value is None or isinstance(value, Placement):
        return value
    hint = ""
    if isinstance(value, (tuple, list)):
        hint = " (this argument takes one placement for the 1-D mesh, not a sequence)"
    elif type(value).__name__ in ("Shard", "Replicate", "Partial"):
        hint = f" (a {type(value).__module__}.{type(value).__name__}; use hyper_parallel's placement classes)"
    raise TypeError(f"{style}: {arg} must be {_PLACEMENT_HELP} or None, got {value!r}{hint}")


def _check_layouts(style: str, arg: str, value) -> Optional[Tuple[Optional[Placement], ...]]:
    """A placement or a tuple/list of (placement or None), one per input/output; None stays None."""
    if value is None:
        return None
    if isinstance(value, Placement):
        return (value,)
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{style}: {arg} must be {_PLACEMENT_HELP}, a tuple of placements (None entries allowed) "
                        f"or None, got {value!r} ({type(value).__name__})")
    for i, p in enumerate(value):
        if p is not None and not isinstance(p, Placement):
            raise TypeError(f"{style}: {arg}[{i}] must be {_PLACEMENT_HELP} or None, got {p!r} "
                            f"({type(p).__name__}) in {arg}={value!r}")
    return tuple(value)


def _check_kwarg_layouts(style: str, arg: str, value) -> Optional[dict]:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"{style}: {arg} must be a dict from keyword-argument names to placements (or None), "
                        f"got {value!r} ({type(value).__name__})")
    for k, p in value.items():
        if not isinstance(k, str):
            raise TypeError(f"{style}: {arg} keys must be keyword-argument names (str), got {k!r} in {arg}={value!r}")
        if p is not None and not isinstance(p, Placement):
            raise TypeError(f"{style}: {arg}[{k!r}] must be {_PLACEMENT_HELP} or None, got {p!r} "
                            f"({type(p).__name__})")
    return dict(value)


class LayoutLengthError(ValueError, AssertionError):
    """Layout tuples of different lengths: a ValueError, and the AssertionError PyTorch's styles raise."""


def _check_pairs(style: str, arg: str, layouts, desired_arg: str, desired):
    """``layouts`` and ``desired`` tuples: same length; a desired layout needs a source layout."""
    if desired is None:
        raise ValueError(f"{style}: {desired_arg} is required when {arg} is given ({arg}={layouts!r}); "
                         f"give one entry per {arg} entry (None: no redistribution)")
    if len(layouts) != len(desired):
        raise LayoutLengthError(f"{style}: {arg} and {desired_arg} must have the same length, got {arg}={layouts!r} "
                                f"({len(layouts)} entries) and {desired_arg}={desired!r} ({len(desired)} entries); "
                                f"{arg} and {desired_arg} should have same length!")
    for i, (lay, want) in enumerate(zip(layouts, desired)):
        if lay is None and want is not None:
            raise ValueError(f"{style}: {desired_arg}[{i}]={want!r} but {arg}[{i}] is None (None means 'leave "
                             f"this one unchanged'); give {arg}[{i}], the layout it arrives with, or set "
                             f"{desired_arg}[{i}] to None")


# ----------------------------------------------------------------------------- conversions
def _pl(placement) -> Optional[Tuple[Placement, ...]]:
    """A style placement as a placements tuple for the 1-D mesh."""
    if placement is None:
        return None
    return (placement,)


def _norm_shard(pls, ndim):
    return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) and ndim else p for p in pls)


def _to_dtensor(value, mesh, input_layout, desired_layout):
    """Plain tensor -> DTensor (with ``input_layout``), then redistribute to ``desired_layout``."""
    if isinstance(value, DTensor):
        dt = value
    elif isinstance(value, torch.Tensor):
        if input_layout is None:
            return value
        dt = DTensor.from_local(value, mesh, _norm_shard(_pl(input_layout), value.ndim), run_check=False)
    else:
        return value
    if desired_layout is not None:
        want = _norm_shard(_pl(desired_layout), dt.ndim)
        if tuple(dt.placements) != want:
            dt = dt.redistribute(mesh, want)
    return dt


def _finish(value, mesh, output_layout, use_local_output):
    if isinstance(value, DTensor):
        if output_layout is not None:
            want = _norm_shard(_pl(output_layout), value.ndim)
            if tuple(value.placements) != want:
                value = value.redistribute(mesh, want)
        return value.to_local() if use_local_output else value
    return value


def _distribute_param(module, name, mesh, placements, src_data_rank):
    """Replace ``module.<name>`` by a DTensor parameter (shared parameters stay shared)."""
    param = getattr(module, name, None)
    if param is None:
        return
    if isinstance(param, DTensor):
        return
    # A parameter shared by two modules (tied embeddings) is converted once and stays shared.
    new = getattr(param, "_hp_distributed", None)
    if new is None:
        dt = distribute_tensor(param.data, mesh, placements, src_data_rank=src_data_rank)
        new = nn.Parameter(dt, requires_grad=param.requires_grad)
        param._hp_distributed = new
    elif tuple(new.placements) != tuple(placements):
        raise ValueError(f"parameter {name} of {_where(module)} is shared with a module that sharded it as "
                         f"{new.placements}, but this style wants {tuple(placements)}")
    module.register_parameter(name, new)


class ParallelStyle(ABC):
    """Base class: ``apply(module, device_mesh)`` shards ``module`` in place and returns it."""

    src_data_rank: Optional[int] = 0
    #: True for a style applied to a multi-dimensional mesh by ``parallelize_module`` (the others need 1-D)
    accepts_nd_mesh: bool = False

    @abstractmethod
    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ...

    # PyTorch spells it _apply
    def _apply(self, module, device_mesh):
        return self.apply(module, resolve_mesh(device_mesh, f"{type(self).__name__}._apply"))

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _unsupported(style, module, supported: str):
    raise NotImplementedError(f"{type(style).__name__} supports {supported}; got {_where(module)}")


_LINEAR_EMBEDDING = "nn.Linear and nn.Embedding"


class ColwiseParallel(ParallelStyle):
    """Shard a Linear/Embedding column-wise: output features split across the mesh.

    Args:
        input_layouts: placement of plain-tensor inputs (default ``Replicate()``).
        output_layouts: placement of the output (default ``Shard(-1)``).
        use_local_output: return the local shard instead of a DTensor (default True).

    Raises:
        NotImplementedError: (at apply) for a module that is not ``nn.Linear`` / ``nn.Embedding``.
    """

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True):
        name = type(self).__name__
        self.input_layouts = _check_layout(name, "input_layouts", input_layouts) or Replicate()
        self.output_layouts = _check_layout(name, "output_layouts", output_layouts) or Shard(-1)
        self.desired_input_layouts = Replicate()
        self.use_local_output = _check_bool(name, "use_local_output", use_local_output)

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            _distribute_param(module, "weight", device_mesh, [Shard(0)], self.src_data_rank)
            _distribute_param(module, "bias", device_mesh, [Shard(0)], self.src_data_rank)
        elif isinstance(module, nn.Embedding):
            _distribute_param(module, "weight", device_mesh, [Shard(1)], self.src_data_rank)
        else:
            _unsupported(self, module, _LINEAR_EMBEDDING)
        _install_io_hooks(module, device_mesh, self.input_layouts, self.desired_input_layouts,
                          self.output_layouts, self.use_local_output)
        return module


class RowwiseParallel(ParallelStyle):
    """Shard a Linear/Embedding row-wise: input features (or vocab rows) split across the mesh.

    Args:
        input_layouts: placement of plain-tensor inputs (default ``Shard(-1)``;
            ``Replicate()`` for Embedding).
        output_layouts: placement of the output (default ``Replicate()``: one all_reduce;
            ``Shard(d)``: one reduce_scatter).
        use_local_output: return the local tensor (default True).

    Raises:
        NotImplementedError: (at apply) for a module that is not ``nn.Linear`` / ``nn.Embedding``.
    """

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True):
        name = type(self).__name__
        self.input_layouts = _check_layout(name, "input_layouts", input_layouts)
        self.output_layouts = _check_layout(name, "output_layouts", output_layouts) or Replicate()
        self.use_local_output = _check_bool(name, "use_local_output", use_local_output)

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            _distribute_param(module, "weight", device_mesh, [Shard(1)], self.src_data_rank)
            _distribute_param(module, "bias", device_mesh, [Replicate()], self.src_data_rank)
            desired: Placement = Shard(-1)
        elif isinstance(module, nn.Embedding):
            _distribute_param(module, "weight", device_mesh, [Shard(0)], self.src_data_rank)
            desired = Replicate()
        else:
            _unsupported(self, module, _LINEAR_EMBEDDING)
        inp = self.input_layouts or desired
        _install_io_hooks(module, device_mesh, inp, desired, self.output_layouts, self.use_local_output)
        return module


def _builtin_sequence_parallel_types():
    types = [nn.LayerNorm, nn.Dropout]
    if hasattr(nn, "RMSNorm"):
        types.append(nn.RMSNorm)
    return types


class SequenceParallel(ParallelStyle):
    """Run a per-token module on activations sharded along ``sequence_dim``; parameters replicated.

    Meant for per-token modules (``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.Dropout``, a
    hand-written RMSNorm...), which then run on the local sequence shard with no
    communication. As in PyTorch any module is accepted: the module runs on a
    sequence-sharded DTensor, so a module that mixes positions (``nn.BatchNorm1d``
    statistics, attention) still computes the right values through the DTensor op
    rules, with the collectives they need. ``register_module_type`` is kept for
    compatibility with earlier releases (registering is no longer required).

    Args:
        sequence_dim: the sharded dimension of the input (default 1).
        use_local_output: return the local tensor (default False: keep the DTensor).
    """

    _registered_types: list = []

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        name = type(self).__name__
        if not isinstance(sequence_dim, int) or isinstance(sequence_dim, bool):
            raise TypeError(f"{name}: sequence_dim must be an int (the sharded input dimension), got "
                            f"{sequence_dim!r} ({type(sequence_dim).__name__})")
        self.sequence_dim = sequence_dim
        self.use_local_output = _check_bool(name, "use_local_output", use_local_output)

    @classmethod
    def register_module_type(cls, module_type: _ModuleType) -> _ModuleType:
        """Record ``module_type`` as a per-token module; returns ``module_type`` (kept for compatibility).

        ``SequenceParallel`` accepts every module (as PyTorch's does); the registry only
        feeds :meth:`supported_module_types`, the list of modules known to run on a
        sequence shard with no communication.
        """
        if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
            raise TypeError(f"SequenceParallel.register_module_type: module_type must be an nn.Module subclass, "
                            f"got {module_type!r}")
        if module_type not in SequenceParallel._registered_types:
            SequenceParallel._registered_types.append(module_type)
        return module_type

    @classmethod
    def supported_module_types(cls) -> tuple:
        """The built-in types plus the registered ones."""
        return tuple(_builtin_sequence_parallel_types()) + tuple(SequenceParallel._registered_types)

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Module):
            raise TypeError(f"SequenceParallel: module must be an nn.Module, got {type(module).__name__}")
        for name, _ in list(module.named_parameters(recurse=False)):
            _distribute_param(module, name, device_mesh, [Replicate()], self.src_data_rank)
        seq_dim = self.sequence_dim
        where = _where(module)

        def pre(mod, args, kwargs):
            if not args:
                return None
            x = args[0]
            if isinstance(x, torch.Tensor) and not -x.ndim <= seq_dim < x.ndim:
                raise ValueError(f"SequenceParallel on {where}: sequence_dim={seq_dim} is out of range for the "
                                 f"input of shape {tuple(x.shape)} ({x.ndim} dims)")
            x = _to_dtensor(x, device_mesh, Shard(seq_dim), Shard(seq_dim))
            return (x,) + tuple(args[1:]), kwargs
        module.register_forward_pre_hook(pre, with_kwargs=True)

        def post(mod, args, out):
            return _finish(out, device_mesh, None, self.use_local_output)
        module.register_forward_hook(post)
        return module


class NoParallel(ParallelStyle):
    """Keep the module whole on every rank: parameters replicated, inputs/outputs converted.

    Args:
        input_layout: placement of plain-tensor inputs (default ``Replicate()``); the input
            is redistributed to ``Replicate()``.
        output_layout: placement of the output (default ``Replicate()``).
        use_local_output: return the local tensor (default True).
    """

    def __init__(self, *, input_layout: Optional[Placement] = None, output_layout: Optional[Placement] = None,
                 use_local_output: bool = True):
        name = type(self).__name__
        self.input_layout = _check_layout(name, "input_layout", input_layout) or Replicate()
        self.output_layout = _check_layout(name, "output_layout", output_layout) or Replicate()
        self.use_local_output = _check_bool(name, "use_local_output", use_local_output)

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=True)):
            owner, leaf = _owner(module, name)
            _distribute_param(owner, leaf, device_mesh, [Replicate()], self.src_data_rank)
        _install_io_hooks(module, device_mesh, self.input_layout, Replicate(), self.output_layout,
                          self.use_local_output)
        return module


def _owner(module, fqn):
    parts = fqn.split(".")
    for p in parts[:-1]:
        module = getattr(module, p)
    return module, parts[-1]


def _install_io_hooks(module, mesh, input_layout, desired_input_layout, output_layout, use_local_output):
    def pre(mod, args):
        if not args:
            return None
        x = _to_dtensor(args[0], mesh, input_layout, desired_input_layout)
        return (x,) + tuple(args[1:])
    module.register_forward_pre_hook(pre)

    def post(mod, args, out):
        return _finish(out, mesh, output_layout, use_local_output)
    module.register_forward_hook(post)


def _prepare(style, where, what, value, mesh, layout, desired, use_local):
    """Convert one input/output of a PrepareModule* style (``layout`` None: unchanged)."""
    if layout is None:
        return value
    if isinstance(value, DTensor):
        if tuple(value.placements) != _norm_shard(_pl(layout), value.ndim):
            raise ValueError(f"{style} on {where}: {what} is a DTensor with placements {tuple(value.placements)} but "
                             f"its layout is given as {layout!r}")
    elif not isinstance(value, torch.Tensor):
        raise TypeError(f"{style} on {where}: {what} is {type(value).__name__}, not a tensor, but its layout is "
                        f"given as {layout!r}; use None for inputs/outputs to leave unchanged")
    dt = _to_dtensor(value, mesh, layout, desired)
    return dt.to_local() if use_local and isinstance(dt, DTensor) else dt


class PrepareModuleInput(ParallelStyle):
    """Convert/redistribute a module's inputs before its forward.

    Args:
        input_layouts: per positional input, the placement it arrives with when it
            is a plain tensor (``None``: leave that input alone). One placement or a tuple.
        desired_input_layouts: per positional input, the placement to redistribute to
            (required with ``input_layouts``, same length; ``None`` entries: no redistribution).
        input_kwarg_layouts / desired_input_kwarg_layouts: the same for keyword inputs, as
            dicts keyed by argument name (same keys).
        use_local_output: hand local tensors to the module (default False).
    """

    def __init__(self, *, input_layouts: LayoutsArg = None, desired_input_layouts: LayoutsArg = None,
                 input_kwarg_layouts: KwargLayoutsArg = None, desired_input_kwarg_layouts: KwargLayoutsArg = None,
                 use_local_output: bool = False):
        self._setup(type(self).__name__, input_layouts, desired_input_layouts, input_kwarg_layouts,
                    desired_input_kwarg_layouts, use_local_output, "use_local_output")

    def _setup(self, style, input_layouts, desired_input_layouts, input_kwarg_layouts,
               desired_input_kwarg_layouts, use_local_output, use_local_name):
        self._style = style
        self.input_layouts = _check_layouts(style, "input_layouts", input_layouts)
        self.desired_input_layouts = _check_layouts(style, "desired_input_layouts", desired_input_layouts)
        if self.input_layouts is not None:
            _check_pairs(style, "input_layouts", self.input_layouts, "desired_input_layouts",
                         self.desired_input_layouts)
        elif self.desired_input_layouts is not None:
            raise ValueError(f"{style}: desired_input_layouts={self.desired_input_layouts!r} needs input_layouts "
                             f"(the layouts the inputs arrive with), got input_layouts=None")
        kw = _check_kwarg_layouts(style, "input_kwarg_layouts", input_kwarg_layouts)
        dkw = _check_kwarg_layouts(style, "desired_input_kwarg_layouts", desired_input_kwarg_layouts)
        if (kw or dkw) and set(kw or {}) != set(dkw or {}):
            raise ValueError(f"{style}: input_kwarg_layouts and desired_input_kwarg_layouts must have the same keys, "
                             f"got input_kwarg_layouts={kw!r} and desired_input_kwarg_layouts={dkw!r}")
        for k in (kw or {}):
            if kw[k] is None and dkw[k] is not None:
                raise ValueError(f"{style}: desired_input_kwarg_layouts[{k!r}]={dkw[k]!r} but "
                                 f"input_kwarg_layouts[{k!r}] is None (None means 'leave unchanged')")
        self.input_kwarg_layouts = kw or {}
        self.desired_input_kwarg_layouts = dkw or {}
        self.use_local_output = _check_bool(style, use_local_name, use_local_output)

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style, where = self._style, _where(module)

        def pre(mod, args, kwargs):
            new_args = list(args)
            if self.input_layouts is not None:
                if len(args) != len(self.input_layouts):  # as PyTorch: one entry per positional input
                    raise ValueError(f"{style} on {where}: the module received {len(args)} positional inputs but "
                                     f"input_layouts={self.input_layouts!r} has {len(self.input_layouts)} entries "
                                     "(module inputs and input_layouts should have same length!); give None "
                                     "for inputs to leave unchanged")
                for i, lay in enumerate(self.input_layouts):
                    new_args[i] = _prepare(style, where, f"input {i}", args[i], device_mesh, lay,
                                           self.desired_input_layouts[i], self.use_local_output)
            new_kwargs = dict(kwargs)
            for k, lay in self.input_kwarg_layouts.items():
                if k in kwargs:
                    new_kwargs[k] = _prepare(style, where, f"keyword input {k!r}", kwargs[k], device_mesh, lay,
                                             self.desired_input_kwarg_layouts[k], self.use_local_output)
            return tuple(new_args), new_kwargs
        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module


class PrepareModuleOutput(ParallelStyle):
    """Redistribute a module's outputs after its forward.

    Args:
        output_layouts: per output, the placement it has when it is a plain tensor
            (``None``: leave that output alone). One placement or a tuple; required.
        desired_output_layouts: per output, the placement to redistribute to (same length;
            required).
        use_local_output: return local tensors (default True).
    """

    def __init__(self, *, output_layouts: LayoutsArg, desired_output_layouts: LayoutsArg,
                 use_local_output: bool = True):
        self._setup(type(self).__name__, output_layouts, desired_output_layouts, use_local_output)

    def _setup(self, style, output_layouts, desired_output_layouts, use_local_output):
        self._style = style
        self.output_layouts = _check_layouts(style, "output_layouts", output_layouts)
        self.desired_output_layouts = _check_layouts(style, "desired_output_layouts", desired_output_layouts)
        if self.output_layouts is None:
            raise ValueError(f"{style}: output_layouts is required (a placement, or a tuple with one entry per "
                             f"module output, None entries for outputs to leave unchanged), got None")
        _check_pairs(style, "output_layouts", self.output_layouts, "desired_output_layouts",
                     self.desired_output_layouts)
        self.use_local_output = _check_bool(style, "use_local_output", use_local_output)

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style, where = self._style, _where(module)

        def post(mod, args, out):
            single = not isinstance(out, (tuple, list))
            outs = [out] if single else list(out)
            if len(outs) != len(self.output_layouts):
                raise ValueError(f"{style} on {where}: the module returned {len(outs)} outputs but "
                                 f"output_layouts={self.output_layouts!r} has {len(self.output_layouts)} entries")
            res = [_prepare(style, where, f"output {i}", o, device_mesh, lay, want, self.use_local_output)
                   for i, (o, lay, want) in enumerate(zip(outs, self.output_layouts, self.desired_output_layouts))]
            return res[0] if single else type(out)(res)
        module.register_forward_hook(post)
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module.

    ``use_local_input`` is PrepareModuleInput's ``use_local_output``; ``output_layouts``
    and ``desired_output_layouts`` are required.
    """

    def __init__(self, *, input_layouts: LayoutsArg = None, desired_input_layouts: LayoutsArg = None,
                 input_kwarg_layouts: KwargLayoutsArg = None, desired_input_kwarg_layouts: KwargLayoutsArg = None,
                 use_local_input: bool = False, output_layouts: LayoutsArg, desired_output_layouts: LayoutsArg,
                 use_local_output: bool = True):
        name = type(self).__name__
        self.prepare_input = PrepareModuleInput.__new__(PrepareModuleInput)
        self.prepare_input._setup(name, input_layouts, desired_input_layouts, input_kwarg_layouts,
                                  desired_input_kwarg_layouts, use_local_input, "use_local_input")
        self.prepare_output = PrepareModuleOutput.__new__(PrepareModuleOutput)
        self.prepare_output._setup(name, output_layouts, desired_output_layouts, use_local_output)

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_input.apply(module, device_mesh)
        self.prepare_output.apply(module, device_mesh)
        return module


__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "NoParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"]
