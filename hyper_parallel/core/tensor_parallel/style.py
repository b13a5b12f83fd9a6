"""Parallel styles: how one module is sharded over a 1-D mesh (PyTorch's contract).

A style distributes the module's parameters and installs forward hooks that
convert inputs/outputs between plain tensors and DTensors:

* ``ColwiseParallel``: Linear weight/bias ``Shard(0)`` (output features), Embedding
  weight ``Shard(1)``; input replicated, output ``Shard(-1)``.
* ``RowwiseParallel``: Linear weight ``Shard(1)``, bias replicated (added once);
  Embedding weight ``Shard(0)`` (vocab rows, masked lookup); output partial,
  reduced to ``Replicate`` (or reduce-scattered to ``Shard(d)``).
* ``SequenceParallel``: LayerNorm/RMSNorm/Dropout on sequence-sharded activations;
  parameters replicated.
* ``PrepareModuleInput`` / ``PrepareModuleOutput`` / ``PrepareModuleInputOutput``:
  only redistribute inputs/outputs; ``None`` entries are left unchanged.
* ``NoParallel``: parameters replicated, inputs/outputs converted.

``use_local_output=True`` hands plain local tensors to the next module, which
is how torchtitan-style plans keep the model code unchanged.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Tuple

from hyper_parallel.core.dtensor.api import distribute_tensor
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, Shard
from hyper_parallel.platform import get_platform

platform = get_platform()
nn = platform.nn


def _pl(p) -> Tuple[Placement, ...]:
    """A style placement (one Placement, or a tuple for one mesh dim) as a placements tuple."""
    if p is None:
        return None
    if isinstance(p, Placement):
        return (p,)
    if isinstance(p, (tuple, list)) and len(p) == 1 and isinstance(p[0], Placement):
        return tuple(p)
    raise TypeError(f"expected a Placement (Shard(d), Replicate() or Partial()) for a 1-D mesh, got {p!r}")


def _to_dtensor(x, mesh, input_layout, desired_layout, *, what):
    """Plain tensor -> DTensor (with ``input_layout``), then redistribute to ``desired_layout``."""
    if isinstance(x, DTensor):
        dt = x
    elif isinstance(x, platform.Tensor):
        if input_layout is None:
            return x
        dt = DTensor.from_local(x, mesh, _pl(input_layout), run_check=False)
    else:
        return x
    if desired_layout is not None:
        want = _norm_shard(_pl(desired_layout), dt.ndim)
        if tuple(dt.placements) != want:
            dt = dt.redistribute(mesh, want)
    return dt


def _norm_shard(pls, ndim):
    return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) and ndim else p for p in pls)


def _finish(x, mesh, output_layout, use_local_output):
    if isinstance(x, DTensor):
        if output_layout is not None:
            want = _norm_shard(_pl(output_layout), x.ndim)
            if tuple(x.placements) != want:
                x = x.redistribute(mesh, want)
        return x.to_local() if use_local_output else x
    return x


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
        raise ValueError(f"parameter {name} of {type(module).__name__} is shared with a module that sharded it as "
                         f"{new.placements}, but this style wants {tuple(placements)}")
    module.register_parameter(name, new)


class ParallelStyle(ABC):
    """Base class: ``apply(module, device_mesh)`` shards ``module`` in place and returns it."""

    src_data_rank: Optional[int] = 0

    @abstractmethod
    def apply(self, module, device_mesh: DeviceMesh):
        ...

    # PyTorch spells it _apply
    def _apply(self, module, device_mesh):
        return self.apply(module, device_mesh)

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _unsupported(style, module):
    raise NotImplementedError(f"{type(style).__name__} supports nn.Linear and nn.Embedding"
                              f"{' and norms/dropout' if isinstance(style, SequenceParallel) else ''}; "
                              f"got {type(module).__name__}")


class ColwiseParallel(ParallelStyle):
    """Shard a Linear/Embedding column-wise: output features split across the mesh.

    Args:
        input_layouts: placement of plain-tensor inputs (default ``Replicate()``).
        output_layouts: placement of the output (default ``Shard(-1)``).
        use_local_output: return the local shard instead of a DTensor (default True).
    """

    def __init__(self, *, input_layouts: Placement = None, output_layouts: Placement = None,
                 use_local_output: bool = True):
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts or Shard(-1)
        self.desired_input_layouts = Replicate()
        self.use_local_output = use_local_output

    def apply(self, module, device_mesh):
        if isinstance(module, nn.Linear):
            _distribute_param(module, "weight", device_mesh, [Shard(0)], self.src_data_rank)
            _distribute_param(module, "bias", device_mesh, [Shard(0)], self.src_data_rank)
        elif isinstance(module, nn.Embedding):
            _distribute_param(module, "weight", device_mesh, [Shard(1)], self.src_data_rank)
        else:
            _unsupported(self, module)
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
    """

    def __init__(self, *, input_layouts: Placement = None, output_layouts: Placement = None,
                 use_local_output: bool = True):
        self.input_layouts = input_layouts
        self.output_layouts = output_layouts or Replicate()
        self.use_local_output = use_local_output

    def apply(self, module, device_mesh):
        if isinstance(module, nn.Linear):
            _distribute_param(module, "weight", device_mesh, [Shard(1)], self.src_data_rank)
            _distribute_param(module, "bias", device_mesh, [Replicate()], self.src_data_rank)
            desired = Shard(-1)
        elif isinstance(module, nn.Embedding):
            _distribute_param(module, "weight", device_mesh, [Shard(0)], self.src_data_rank)
            desired = Replicate()
        else:
            _unsupported(self, module)
        inp = self.input_layouts or desired
        _install_io_hooks(module, device_mesh, inp, desired, self.output_layouts, self.use_local_output)
        return module


class SequenceParallel(ParallelStyle):
    """Run a norm/dropout on activations sharded along ``sequence_dim``; parameters replicated.

    Args:
        sequence_dim: the sharded dimension of the input (default 1).
        use_local_output: return the local tensor (default False: keep the DTensor).
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def apply(self, module, device_mesh):
        supported = [nn.LayerNorm, nn.Dropout]
        if hasattr(nn, "RMSNorm"):
            supported.append(nn.RMSNorm)
        if not (isinstance(module, tuple(supported)) or "norm" in type(module).__name__.lower()):
            _unsupported(self, module)
        for name, p in list(module.named_parameters(recurse=False)):
            _distribute_param(module, name, device_mesh, [Replicate()], self.src_data_rank)
        seq = Shard(self.sequence_dim)

        def pre(mod, args, kwargs):
            if not args:
                return None
            x = _to_dtensor(args[0], device_mesh, seq, seq, what="input")
            return (x,) + tuple(args[1:]), kwargs
        module.register_forward_pre_hook(pre, with_kwargs=True)

        def post(mod, args, out):
            return _finish(out, device_mesh, None, self.use_local_output)
        module.register_forward_hook(post)
        return module


class NoParallel(ParallelStyle):
    """Keep the module whole on every rank: parameters replicated, inputs/outputs converted."""

    def __init__(self, *, input_layout: Placement = None, output_layout: Placement = None,
                 use_local_output: bool = True):
        self.input_layout = input_layout or Replicate()
        self.output_layout = output_layout or Replicate()
        self.use_local_output = use_local_output

    def apply(self, module, device_mesh):
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
        x = _to_dtensor(args[0], mesh, input_layout, desired_input_layout, what="input")
        return (x,) + tuple(args[1:])
    module.register_forward_pre_hook(pre)

    def post(mod, args, out):
        return _finish(out, mesh, output_layout, use_local_output)
    module.register_forward_hook(post)


class PrepareModuleInput(ParallelStyle):
    """Convert/redistribute a module's inputs before its forward.

    Args:
        input_layouts: per positional input, the placement it arrives with when it
            is a plain tensor (``None``: leave that input alone).
        desired_input_layouts: per positional input, the placement to redistribute to.
        input_kwarg_layouts / desired_input_kwarg_layouts: the same for keyword inputs.
        use_local_output: hand local tensors to the module (default False).
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_output: bool = False):
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        if self.input_layouts is not None and self.desired_input_layouts is not None and \
                len(self.input_layouts) != len(self.desired_input_layouts):
            raise ValueError(f"PrepareModuleInput: input_layouts {self.input_layouts} and desired_input_layouts "
                             f"{self.desired_input_layouts} must have the same length")
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        self.use_local_output = use_local_output

    def _convert(self, x, mesh, layout, desired):
        if layout is None:
            return x
        if isinstance(x, DTensor) and layout is not None and tuple(x.placements) != _norm_shard(_pl(layout), x.ndim):
            raise ValueError(f"PrepareModuleInput: input has placements {x.placements} but input_layouts says "
                             f"{layout}")
        dt = _to_dtensor(x, mesh, layout, desired, what="input")
        return dt.to_local() if self.use_local_output and isinstance(dt, DTensor) else dt

    def apply(self, module, device_mesh):
        def pre(mod, args, kwargs):
            new_args = list(args)
            if self.input_layouts is not None:
                if len(args) < len(self.input_layouts):
                    raise ValueError(f"PrepareModuleInput on {type(mod).__name__}: module received {len(args)} "
                                     f"positional inputs but input_layouts has {len(self.input_layouts)}")
                for i, lay in enumerate(self.input_layouts):
                    desired = self.desired_input_layouts[i] if self.desired_input_layouts else None
                    new_args[i] = self._convert(args[i], device_mesh, lay, desired)
            new_kwargs = dict(kwargs)
            for k, lay in self.input_kwarg_layouts.items():
                if k in kwargs:
                    new_kwargs[k] = self._convert(kwargs[k], device_mesh, lay,
                                                  self.desired_input_kwarg_layouts.get(k))
            return tuple(new_args), new_kwargs
        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module


class PrepareModuleOutput(ParallelStyle):
    """Redistribute a module's outputs after its forward.

    Args:
        output_layouts: per output, the placement it has when it is a plain tensor
            (``None``: leave that output alone).
        desired_output_layouts: per output, the placement to redistribute to.
        use_local_output: return local tensors (default True).
    """

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True):
        self.output_layouts = _as_tuple(output_layouts)
        self.desired_output_layouts = _as_tuple(desired_output_layouts)
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(f"PrepareModuleOutput: output_layouts {self.output_layouts} and desired_output_layouts "
                             f"{self.desired_output_layouts} must have the same length")
        self.use_local_output = use_local_output

    def apply(self, module, device_mesh):
        def post(mod, args, out):
            single = not isinstance(out, (tuple, list))
            outs = [out] if single else list(out)
            if len(outs) != len(self.output_layouts):
                raise ValueError(f"PrepareModuleOutput on {type(mod).__name__}: module returned {len(outs)} outputs "
                                 f"but output_layouts has {len(self.output_layouts)}")
            res = []
            for o, lay, want in zip(outs, self.output_layouts, self.desired_output_layouts):
                if lay is None:
                    res.append(o)
                    continue
                dt = _to_dtensor(o, device_mesh, lay, want, what="output")
                res.append(dt.to_local() if self.use_local_output and isinstance(dt, DTensor) else dt)
            return res[0] if single else type(out)(res)
        module.register_forward_hook(post)
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_input: bool = False, output_layouts=None,
                 desired_output_layouts=None, use_local_output: bool = True):
        self.prepare_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def apply(self, module, device_mesh):
        self.prepare_input.apply(module, device_mesh)
        self.prepare_output.apply(module, device_mesh)
        return module


def _as_tuple(x):
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return tuple(x)
    return (x,)


__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "NoParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"]
