"""State-dict helpers for models whose parameters and optimizer states are hyper_parallel DTensors.

Mirrors ``torch.distributed.checkpoint.state_dict`` (torch 2.13) so that a training
script written against it works with our DTensors:

* keys are canonical fully-qualified names (FQNs): ``torch.compile``'s
  ``_orig_mod.`` and activation checkpointing's ``_checkpoint_wrapped_module.``
  segments are dropped, and optimizer state is keyed by the FQN of its
  parameter instead of the optimizer's integer ids, so the dict means the same
  thing whatever the parallel layout (and DCP can reshard it);
* the sharded (default) state dict holds the live tensors: ``dcp.load`` writes
  into the model's parameters and the optimizer's states in place;
* ``full_state_dict=True`` gathers plain full tensors (with ``cpu_offload=True``
  only rank 0 keeps them, the others get an empty dict, as in torch);
* ``broadcast_from_rank0=True`` loads a full plain state dict that only rank 0
  holds (a single-process or Hugging Face checkpoint) into a parallelized model:
  rank 0 broadcasts each tensor and every rank keeps its own box of it.

DTensors are recognised by duck typing (the class defines ``__hp_stage__``), so
this module needs nothing from the layers above it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Protocol, Set, Tuple, TypeGuard, Union

import torch
import torch.distributed as dist

#: what the optimizer helpers take: one optimizer or several (torchtitan's model parts)
Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]

_FQN_SKIP = ("_orig_mod.", "_checkpoint_wrapped_module.")


@dataclass
class StateDictOptions:
    """How the state-dict helpers build and load state dicts (torch's fields of the same names).

    full_state_dict: plain full tensors instead of DTensors (gathered; collective).
    cpu_offload: independent CPU copies of the tensors; with ``full_state_dict`` only rank 0 keeps them.
    strict: loading raises on missing or unexpected model keys.
    broadcast_from_rank0: loading takes a full state dict held by rank 0 only and
        broadcasts it (implies ``full_state_dict`` for loading).
    """
    full_state_dict: bool = False
    cpu_offload: bool = False
    strict: bool = True
    broadcast_from_rank0: bool = False

    def __post_init__(self) -> None:
        for name in ("full_state_dict", "cpu_offload", "strict", "broadcast_from_rank0"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise TypeError(f"StateDictOptions.{name} must be a bool, got {v!r}")


class IncompatibleKeys(NamedTuple):
    missing_keys: List[str]
    unexpected_keys: List[str]


# ---------------------------------------------------------------------------------------------- helpers
class _DTensorLike(Protocol):
    """What these helpers read of a DTensor (this package sits below ``dtensor``: duck typing, see above)."""

    _local_tensor: torch.Tensor
    _layout: Any
    device_mesh: Any
    shape: torch.Size

    def detach(self) -> Any: ...

    def full_tensor(self) -> torch.Tensor: ...

    def redistribute(self, device_mesh: Any, placements: Any) -> Any: ...

    def reduce_partial(self) -> Any: ...


def _is_dtensor(obj: object) -> TypeGuard[_DTensorLike]:
    return isinstance(obj, torch.Tensor) and hasattr(type(obj), "__hp_stage__")


def _options(options) -> StateDictOptions:
    if options is None:
        return StateDictOptions()
    if not isinstance(options, StateDictOptions):
        raise TypeError(f"options must be a hyper_parallel.checkpoint.StateDictOptions, got {type(options).__name__}")
    return options


def _canonical(fqn: str) -> str:
    for seg in _FQN_SKIP:
        fqn = fqn.replace(seg, "")
    return fqn


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _model_entries(model) -> Dict[str, Any]:
    """Canonical FQN -> live tensor (parameters and persistent buffers) or extra-state object."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return {_canonical(k): v for k, v in model.state_dict(keep_vars=True).items()}


def _fsdp_sharded_params(model):
    """(canonical FQN, sharded DTensor) of every ``fully_shard``-managed parameter of ``model``.

    While a ``fully_shard`` group is unsharded (the root between forward and backward,
    or any group with ``reshard_after_forward=False``), its modules hold the unsharded
    tensors, but the optimizer steps the sharded DTensors: those are the parameters the
    state dicts are about. Found by duck typing (``module._hp_fsdp_state.group.params``)
    so nothing is resharded or gathered just to name them.
    """
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    for m in model.modules():
        group = getattr(m.__dict__.get("_hp_fsdp_state"), "group", None)
        for fp in getattr(group, "params", None) or ():
            for owner, attr in fp.owners:
                prefix = names.get(id(owner))
                if prefix is not None:
                    yield _canonical(f"{prefix}.{attr}" if prefix else attr), fp.sharded


def _param_fqns(model) -> Dict[int, str]:
    """id(parameter) -> canonical FQN (the first name of a shared parameter; for a ``fully_shard``-ed
    parameter its sharded DTensor's, whether or not its group is unsharded right now)."""
    out: Dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), _canonical(name))
    for name, p in _fsdp_sharded_params(model):
        out.setdefault(id(p), name)
    return out


def _reduce(tensor):
    """A savable view of a live tensor: detached, Partial placements reduced."""
    if _is_dtensor(tensor):
        return tensor.reduce_partial().detach() if tensor._layout.has_partial() else tensor.detach()
    return tensor.detach() if isinstance(tensor, torch.Tensor) else tensor


def _finish(value, opts: StateDictOptions, keep: bool):
    """Full/offloaded form of one tensor value as the options ask (collective for a full DTensor)."""
    if not isinstance(value, torch.Tensor):
        return value
    if opts.full_state_dict and _is_dtensor(value):
        value = value.full_tensor().detach()  # a fresh tensor object: no collective memo attributes
    if opts.cpu_offload:
        if not keep:
            return None
        # an independent CPU copy (also on CPU devices): later training does not change it
        value = value.to("cpu", copy=True)
    return value


def _shape_error(key, saved, want):
    return ValueError(f"state dict key {key!r}: the value has shape {tuple(saved)} but the model expects "
                      f"global shape {tuple(want)}")


def _box_of(full: torch.Tensor, like):
    """The piece of plain ``full`` (global shape of DTensor ``like``) that this rank holds under ``like``'s layout."""
    coord = like.device_mesh.get_coordinate()
    if getattr(like._layout, "is_strided", False):  # a residual _StridedShard: interleaved ranges
        piece = full
        for d, idx in enumerate(like._layout.local_indices(tuple(like.shape), coord=coord)):
            if idx is not None:
                piece = piece.index_select(d, torch.tensor(idx, dtype=torch.long, device=full.device))
        return piece
    sizes, offsets = like._layout.local_shape_and_offset(tuple(like.shape), coord=coord)
    piece = full
    for d, (off, n) in enumerate(zip(offsets, sizes)):
        if off != 0 or n != full.shape[d]:
            piece = piece.narrow(d, off, n)
    return piece


def _copy_into(target, value, key: str) -> None:
    """Write ``value`` (plain full tensor, or DTensor in any layout of the same mesh) into live ``target``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"state dict key {key!r}: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(target.shape):
        raise _shape_error(key, value.shape, target.shape)
    if value is target:
        return
    with torch.no_grad():
        if _is_dtensor(target):
            if _is_dtensor(value):
                if value._local_tensor is target._local_tensor:
                    return
                if value._layout != target._layout:
                    value = value.redistribute(target.device_mesh, target._layout)
                src = value._local_tensor
            else:
                src = _box_of(value, target)
            target._local_tensor.copy_(src)
        else:
            if _is_dtensor(value):
                value = value.full_tensor()
            target.copy_(value)


# -------------------------------------------------------------------------------------- broadcast from rank 0
def _broadcast_tree(obj: Any) -> Any:
    """Rank 0's nested dict/list of tensors and plain values, returned on every rank (collective).

    The skeleton (with tensor shapes and dtypes) goes as one pickled object, then each
    tensor is broadcast on its own, so peak extra memory is one tensor per rank beyond
    the result.
    """
    if not _distributed():
        return obj
    tensors: List[torch.Tensor] = []

    def strip(obj):
        if isinstance(obj, torch.Tensor):
            if _is_dtensor(obj):
                raise TypeError("broadcast_from_rank0: rank 0's state dict must hold plain (full) tensors, "
                                "got a DTensor")
            tensors.append(obj.detach())
            return ("__hp_tensor__", len(tensors) - 1, tuple(obj.shape), obj.dtype)
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(strip(v) for v in obj)
        return obj

    box = [strip(obj) if _rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    skeleton = box[0]
    if _rank() != 0:
        tensors = []

    def fill(obj):
        if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "__hp_tensor__":
            _, i, shape, dtype = obj
            t = tensors[i].contiguous() if _rank() == 0 else torch.empty(shape, dtype=dtype)
            dist.broadcast(t, src=0)
            return t
        if isinstance(obj, dict):
            return {k: fill(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [fill(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(fill(v) for v in obj)
        return obj

    return fill(skeleton)


# ------------------------------------------------------------------------------------------------ model
def get_model_state_dict(model: torch.nn.Module, *, submodules: Optional[Set[torch.nn.Module]] = None,
                         options: Optional[StateDictOptions] = None) -> Dict[str, Any]:
    """The model's state dict keyed by canonical FQN (DTensors as they are, or full tensors; see options)."""
    opts = _options(options)
    if submodules is not None:
        raise NotImplementedError("get_model_state_dict: submodules= is deprecated in torch and not supported")
    keep = not opts.cpu_offload or not opts.full_state_dict or _rank() == 0
    out = {}
    for k, v in _model_entries(model).items():
        v = _finish(_reduce(v), opts, keep)
        if keep:
            out[k] = v
    return out


def set_model_state_dict(model: torch.nn.Module, model_state_dict: Dict[str, Any], *,
                         options: Optional[StateDictOptions] = None) -> IncompatibleKeys:
    """Load ``model_state_dict`` (sharded DTensors, full tensors, or rank 0's full dict) into ``model``.

    Returns the missing and unexpected keys; with ``strict`` (default) either kind raises.
    """
    opts = _options(options)
    if not isinstance(model_state_dict, dict):
        raise TypeError(f"model_state_dict must be a dict, got {type(model_state_dict).__name__}")
    if opts.broadcast_from_rank0:
        model_state_dict = _broadcast_tree(model_state_dict)
    entries = _model_entries(model)
    given = {_canonical(k): v for k, v in model_state_dict.items()}
    missing = [k for k in entries if k not in given]
    unexpected = [k for k in given if k not in entries]
    if opts.strict and (missing or unexpected):
        raise RuntimeError(f"set_model_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    extra = {}
    for k, target in entries.items():
        if k not in given:
            continue
        if isinstance(target, torch.Tensor):
            _copy_into(target, given[k], k)
        else:
            extra[k] = given[k]
    if extra:  # extra states (get_extra_state) go through the module's own loader
        model.load_state_dict(extra, strict=False)
    return IncompatibleKeys(missing, unexpected)


# -------------------------------------------------------------------------------------------- optimizer
def _as_optimizers(optimizers) -> tuple:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    try:
        optims = tuple(optimizers)
    except TypeError:
        raise TypeError(f"optimizers must be a torch.optim.Optimizer or an iterable of them, "
                        f"got {type(optimizers).__name__}") from None
    for o in optims:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizers: expected torch.optim.Optimizer entries, got {type(o).__name__}")
    return optims


def _init_optim_state(optim) -> None:
    """Create the optimizer's lazily built state (one step with zero gradients and lr 0), so
    a fresh optimizer has tensors for ``dcp.load`` to fill, as torch's helper does."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = []
    for g in optim.param_groups:
        if "lr" in g:
            lrs.append(g["lr"])
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optim.step()
    for g in optim.param_groups:
        if "lr" in g:
            g["lr"] = lrs.pop(0)
    optim.zero_grad(set_to_none=True)


def _fqn_of(fqns, param, what):
    name = fqns.get(id(param))
    if name is None:
        raise ValueError(f"{what}: the optimizer holds a parameter of shape {tuple(param.shape)} that is not a "
                         "parameter of the model")
    return name


def get_optimizer_state_dict(model: torch.nn.Module, optimizers: Optimizers, *,
                             submodules: Optional[Set[torch.nn.Module]] = None,
                             options: Optional[StateDictOptions] = None) -> Dict[str, Any]:
    """Optimizer state keyed by parameter FQN: ``{"state": {fqn: {...}}, "param_groups": [{"params": [fqn...]}]}``."""
    opts = _options(options)
    if submodules is not None:
        raise NotImplementedError("get_optimizer_state_dict: submodules= is not supported")
    optims = _as_optimizers(optimizers)
    fqns = _param_fqns(model)
    keep = not opts.cpu_offload or not opts.full_state_dict or _rank() == 0
    state, groups = {}, []
    for optim in optims:
        _init_optim_state(optim)
        for g in optim.param_groups:
            names = [_fqn_of(fqns, p, "get_optimizer_state_dict") for p in g["params"]]
            for p, name in zip(g["params"], names):
                if p in optim.state:
                    state[name] = {k: _finish(_reduce(v), opts, keep) for k, v in optim.state[p].items()}
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    if opts.cpu_offload and opts.full_state_dict and not keep:
        return {}
    return {"state": state, "param_groups": groups}


def set_optimizer_state_dict(model: torch.nn.Module, optimizers: Optimizers, optim_state_dict: Dict[str, Any], *,
                             options: Optional[StateDictOptions] = None) -> None:
    """Load an FQN-keyed optimizer state dict (sharded, full, or rank 0's full one) into ``optimizers``."""
    opts = _options(options)
    optims = _as_optimizers(optimizers)
    if opts.broadcast_from_rank0:
        optim_state_dict = _broadcast_tree(optim_state_dict)
    if not isinstance(optim_state_dict, dict) or "state" not in optim_state_dict \
            or "param_groups" not in optim_state_dict:
        raise ValueError("optim_state_dict must be a dict with 'state' and 'param_groups' (as returned by "
                         f"get_optimizer_state_dict), got {type(optim_state_dict).__name__} with keys "
                         f"{list(optim_state_dict) if isinstance(optim_state_dict, dict) else None}")
    fqns = _param_fqns(model)
    saved_state = {_canonical(k): v for k, v in optim_state_dict["state"].items()}
    saved_groups = {}
    for g in optim_state_dict["param_groups"]:
        for name in g["params"]:
            saved_groups[_canonical(name)] = g
    for optim in optims:
        _init_optim_state(optim)
        id_state, id_groups, idx = {}, [], 0
        for g in optim.param_groups:
            names = [_fqn_of(fqns, p, "set_optimizer_state_dict") for p in g["params"]]
            missing = [n for n in names if n not in saved_groups]
            if missing:
                raise KeyError(f"set_optimizer_state_dict: no saved parameter group holds {missing}")
            src = saved_groups[names[0]]
            ids = []
            for p, name in zip(g["params"], names):
                if name in saved_state:
                    live = optim.state.get(p, {})
                    entry = {}
                    for k, v in saved_state[name].items():
                        t = live.get(k)
                        if isinstance(v, torch.Tensor) and _is_dtensor(t):
                            _copy_into(t, v, f"state.{name}.{k}")
                            v = t
                        elif isinstance(v, torch.Tensor) and isinstance(t, torch.Tensor) and t.dim() == v.dim() \
                                and tuple(t.shape) != tuple(v.shape):
                            raise _shape_error(f"state.{name}.{k}", v.shape, t.shape)
                        elif isinstance(v, torch.Tensor) and not _is_dtensor(v) and v is not t:
                            # Optimizer.load_state_dict keeps a plain tensor it need not cast (Adam's
                            # "step" always) by reference and then steps it in place: copy into the live
                            # state, or clone, so the caller's dict (a full one, rank 0's) stays unchanged
                            if isinstance(t, torch.Tensor) and t.dtype == v.dtype and t.device == v.device \
                                    and tuple(t.shape) == tuple(v.shape):
                                with torch.no_grad():
                                    t.copy_(v)
                                v = t
                            else:
                                v = v.detach().clone()
                        entry[k] = v
                    id_state[idx] = entry
                ids.append(idx)
                idx += 1
            id_groups.append({**{k: v for k, v in src.items() if k != "params"}, "params": ids})
        optim.load_state_dict({"state": id_state, "param_groups": id_groups})


# ---------------------------------------------------------------------------------------------- combined
def get_state_dict(model: torch.nn.Module, optimizers: Optimizers, *,
                   submodules: Optional[Set[torch.nn.Module]] = None,
                   options: Optional[StateDictOptions] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(get_model_state_dict(...), get_optimizer_state_dict(...))``."""
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def set_state_dict(model: torch.nn.Module, optimizers: Optimizers, *, model_state_dict: Dict[str, Any],
                   optim_state_dict: Dict[str, Any], options: Optional[StateDictOptions] = None) -> IncompatibleKeys:
    """Load both; returns the model's missing and unexpected keys."""
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys


# ------------------------------------------------------------------------------------------ checked load
def _describe(metadata) -> str:
    size = getattr(metadata, "size", None)
    return "a non-tensor value" if size is None else f"shape {tuple(size)}"


def _check_files(path, metadata) -> None:
    """Every data file the metadata points at exists and holds the bytes it should (a truncated
    or missing shard file raises naming it, on every rank alike, before any collective)."""
    need: Dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel, end = getattr(info, "relative_path", None), None
        if rel is None:
            continue
        end = getattr(info, "offset", 0) + getattr(info, "length", 0)
        need[rel] = max(need.get(rel, 0), end)
    for rel, end in sorted(need.items()):
        f = os.path.join(path, rel)
        try:
            size = os.path.getsize(f)
        except OSError as e:
            raise FileNotFoundError(f"hyper_parallel.checkpoint.load({path}): data file {f} is missing or unreadable "
                                    f"({e}); the checkpoint is incomplete") from None
        if size < end:
            raise ValueError(f"hyper_parallel.checkpoint.load({path}): data file {f} is truncated or corrupted: it has "
                             f"{size} bytes but the checkpoint metadata places data up to byte {end}")


def load(state_dict: Dict[str, Any], *, checkpoint_id: Union[str, os.PathLike], strict: bool = True,
         **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load`` after checking the checkpoint against ``state_dict``.

    Every rank reads the checkpoint's metadata (no collective) and compares it with
    the (flattened) ``state_dict``: with ``strict``, a key missing from the checkpoint,
    a checkpoint key the state dict lacks, or a different global shape raises a
    ValueError naming each key and both shapes, on every rank alike, before any
    rank enters a collective (so none hangs). A directory without DCP metadata
    raises FileNotFoundError, a data file shorter than the metadata says (truncated)
    a ValueError naming the file. Extra keyword arguments go to ``dcp.load``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    path = os.fspath(checkpoint_id)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError as e:
        raise FileNotFoundError(f"hyper_parallel.checkpoint.load: {path} is not a complete checkpoint (no DCP "
                                f"metadata file; the save that wrote it may have died part way): {e}") from None
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state_dict)
    problems = []
    missing = [k for k in flat if k not in saved]
    unexpected = [k for k in saved if k not in flat]
    if missing:
        problems.append(f"missing from the checkpoint: {missing}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the state dict: {unexpected}")
    for k, v in flat.items():
        md = saved.get(k)
        if md is None:
            continue
        size = getattr(md, "size", None)
        if isinstance(v, torch.Tensor) and (size is None or tuple(size) != tuple(v.shape)):
            problems.append(f"key {k!r}: the checkpoint has {_describe(md)}, the state dict expects shape "
                            f"{tuple(v.shape)}")
        elif not isinstance(v, torch.Tensor) and size is not None:
            problems.append(f"key {k!r}: the checkpoint has a tensor of shape {tuple(size)}, the state dict a "
                            f"{type(v).__name__}")
    if problems and (strict or any(p.startswith("key ") for p in problems)):
        shown = [p for p in problems if strict or p.startswith("key ")]
        raise ValueError(f"hyper_parallel.checkpoint.load({path}): the checkpoint does not match the state dict: "
                         + "; ".join(shown))
    _check_files(path, metadata)
    dcp.load(state_dict, checkpoint_id=path, planner=kwargs.pop("planner", None) or
             dcp.DefaultLoadPlanner(allow_partial_load=not strict), **kwargs)


__all__ = ["StateDictOptions", "IncompatibleKeys", "load", "get_state_dict", "set_state_dict", "get_model_state_dict",
           "get_optimizer_state_dict", "set_model_state_dict", "set_optimizer_state_dict"]
