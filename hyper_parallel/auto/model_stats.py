"""Trace one forward + backward of a model on the meta device: FLOPs, saved activations, call order.

Nothing is computed: the model is deep-copied to ``meta`` and run on meta token ids under
``torch.utils.flop_counter.FlopCounterMode``; ``saved_tensors_hooks`` record every tensor autograd
keeps for backward (deduplicated by storage, parameters excluded), attributed to the module that was
running. Data-dependent steps of mixture-of-experts layers cannot run on meta: a grouped-expert module
(``expert_modules``: the library's GroupedExperts or Hugging Face's fused experts) is traced as a balanced
stand-in over its routed rows, and host reads of meta scalars return 0 (and ``bincount`` a meta tensor of
``minlength``), which is what a balanced router would need. How the model is called and where its loss is
found (Hugging Face ``ModelOutput``, ``labels=``): ``model_call``.
"""
from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from hyper_parallel.auto.eager_attention import EagerAttentionSpy
from hyper_parallel.auto.expert_modules import balanced_experts_forward as _balanced_experts_forward
from hyper_parallel.auto.expert_modules import is_grouped_experts
from hyper_parallel.auto.model_call import call_model, loss_of


class _MetaDataDependent(TorchDispatchMode):
    """Host reads of meta tensors return 0; ``bincount`` returns ``minlength`` meta entries."""

    def __init__(self, on_op=None, on_out=None):
        super().__init__()
        self.on_op = on_op
        self.on_out = on_out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on_op is not None:
            self.on_op(func)
        if self.on_out is not None:
            out = self._run(func, args, kwargs)
            self.on_out(func, out)
            return out
        return self._run(func, args, kwargs)

    def _run(self, func, args, kwargs):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return 0 if not args[0].dtype.is_floating_point else 0.0
        if "bincount" in name and args[0].device.type == "meta":
            n = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            return torch.empty(max(int(n), 1), dtype=torch.int64, device="meta")
        return func(*args, **kwargs)


class _FusedAttention(torch.autograd.Function):
    """Stands in for fused attention in the trace: saves what flash attention saves (q, k, v, out, lse)."""

    @staticmethod
    def forward(ctx, out, query, key, value):
        lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
        res = out.clone()
        ctx.save_for_backward(query, key, value, res, lse)
        return res

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _, _ = ctx.saved_tensors
        return None, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@dataclasses.dataclass
class ModuleTrace:
    fqn: str
    cls: str
    calls: int = 0
    n_args: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    saved_bytes: int = 0          # saved while this module was the innermost running one
    linear_order: List[str] = dataclasses.field(default_factory=list)  # child Linear fqns in call order
    sdpa_at: Optional[int] = None  # index into linear_order at which sdpa ran (attention modules)
    sdpa_flops: int = 0
    ops: int = 0                   # aten ops run while this module was the innermost one (forward)
    sac_bytes: int = 0             # outputs of matmuls and attention (what selective AC saves), forward
    tf_ops: int = 0                # torch-function calls (what a DTensor dispatches) in it, innermost (forward)
    ew_bytes: int = 0              # bytes written by its non-matmul, non-view ops, innermost (forward)
    sdpa_skipped: int = 0          # attention FLOPs a causal / sliding-window kernel skips (subtracted), innermost


@dataclasses.dataclass
class Trace:
    batch: int
    seq_len: int
    modules: Dict[str, ModuleTrace]
    fwd_flops: int
    bwd_flops: int
    saved_bytes: int
    sdpa_shapes: List[tuple]           # (q shape, k shape) of every sdpa call
    input_arg_counts: Dict[str, int]
    linear_inputs: Dict[str, int]      # linear fqn -> id of the tensor it consumed (for same-input grouping)
    module_input_id: Dict[str, int]
    fwd_ops: int = 0
    bwd_ops: int = 0

    def subtree(self, prefix: str, attr: str) -> int:
        pre = prefix + "."
        return sum(getattr(t, attr) for f, t in self.modules.items() if f == prefix or f.startswith(pre))


def trace_model(model: nn.Module, seq_len: int, batch: int = 1, example_input=None,
                loss=None) -> Trace:
    """Run one forward/backward of a meta copy of ``model`` on ``[batch, seq_len]`` int64 token ids (or
    ``example_input(batch, seq_len)``) and return per-module FLOPs and saved-activation bytes."""
    blocks = find_blocks(model)
    if blocks is not None:
        path, names_, reps, traced_name = blocks
        if len(set(reps.values())) < len(reps):  # identical blocks: trace one of each kind, copy the numbers
            try:
                t = _trace(_reduced_meta_copy(model, path, set(reps.values())), seq_len, batch, example_input, loss)
                return _expand(t, path, reps, traced_name)
            except Exception:  # noqa: BLE001 - a forward that needs every block: trace the whole model
                pass
    return _trace(copy.deepcopy(model).to("meta"), seq_len, batch, example_input, loss)


def find_blocks(model: nn.Module):
    """(path of the largest ModuleList/ModuleDict, child names, {child: representative child with the same
    class and parameter shapes}, {representative: its name in the reduced copy}) or None."""
    best, best_n = None, 0
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            n = sum(1 for c in m.children() if any(True for _ in c.parameters()))
            if n > best_n:
                best, best_n = name, n
    if best is None:
        return None
    container = model.get_submodule(best)
    reps, seen = {}, {}
    for n, c in container.named_children():
        sig = (type(c).__name__, tuple((k, tuple(p.shape), p.dtype) for k, p in c.named_parameters()),
               tuple(type(x).__name__ for x in c.modules()))
        reps[n] = seen.setdefault(sig, n)
    keep = [n for n in reps if reps[n] == n]
    traced = {n: (n if isinstance(container, nn.ModuleDict) else str(i)) for i, n in enumerate(keep)}
    return best, list(reps), reps, traced


def _reduced_meta_copy(model, path, keep):
    container = model.get_submodule(path)
    memo = {}  # one memo: objects the blocks share with the rest (a Hugging Face config) stay shared in the copy
    if isinstance(container, nn.ModuleDict):
        reduced = nn.ModuleDict({n: copy.deepcopy(c, memo) for n, c in container.named_children() if n in keep})
    else:
        reduced = nn.ModuleList([copy.deepcopy(c, memo) for n, c in container.named_children() if n in keep])
    memo[id(container)] = reduced
    return copy.deepcopy(model, memo).to("meta")


def _expand(trace: "Trace", path: str, reps: Dict[str, str], traced_name: Dict[str, str]) -> "Trace":
    """Copy each traced representative block's numbers to every block of its kind (fqns renamed)."""
    pre = lambda name: f"{path}.{name}" if path else name
    traced_prefix = {pre(traced_name[r]): r for r in traced_name}

    def owner(fqn):
        for tp_, r in traced_prefix.items():
            if fqn == tp_ or fqn.startswith(tp_ + "."):
                return tp_, r
        return None, None

    def rename(fqn, src, dst):
        return dst + fqn[len(src):]

    mods, lin_in, mod_in, nargs = {}, {}, {}, {}
    extra_fwd = extra_ops = 0
    for f, mt in trace.modules.items():
        src, r = owner(f)
        targets = [f] if src is None else [rename(f, src, pre(b)) for b, rb in reps.items() if rb == r]
        for g in targets:
            c = dataclasses.replace(mt, fqn=g, linear_order=[
                rename(x, src, g[: len(g) - (len(f) - len(src))]) if src and (x == src or x.startswith(src + "."))
                else x for x in mt.linear_order])
            mods[g] = c
            if f in trace.linear_inputs:
                lin_in[g] = trace.linear_inputs[f]
            if f in trace.module_input_id:
                mod_in[g] = trace.module_input_id[f]
            nargs[g] = trace.input_arg_counts.get(f, 0)
        if src is not None and f == src:
            extra_fwd += mt.fwd_flops * (len(targets) - 1)
        if src is not None:
            extra_ops += mt.ops * (len(targets) - 1)
    ratio = trace.bwd_flops / max(trace.fwd_flops, 1)
    fwd = trace.fwd_flops + extra_fwd
    saved = sum(m.saved_bytes for m in mods.values())
    shapes = list(trace.sdpa_shapes)
    oratio = trace.bwd_ops / max(trace.fwd_ops, 1)
    return Trace(trace.batch, trace.seq_len, mods, fwd, int(trace.bwd_flops + extra_fwd * ratio), saved, shapes,
                 nargs, lin_in, mod_in, trace.fwd_ops + extra_ops, int(trace.bwd_ops + extra_ops * oratio))


# tensor metadata reads: answered without the op dispatcher (DTensor's fast methods / properties)
_METADATA = {"__get__", "size", "dim", "numel", "stride", "is_contiguous", "data_ptr", "element_size",
             "is_floating_point", "is_complex", "__len__", "__format__", "__repr__", "__hash__",
             "register_hook"}  # (register_hook: the flop counter's module tracker, not the model)


def _trace(meta, seq_len, batch, example_input, loss) -> "Trace":
    names = {m: n for n, m in meta.named_modules()}
    mods_obj = {n: m for m, n in names.items()}
    for m in meta.modules():
        if is_grouped_experts(m):
            m.forward = _balanced_experts_forward(m)
    mods = {n: ModuleTrace(n, type(m).__name__) for m, n in names.items()}
    stack: List[str] = []
    param_storages = {p.untyped_storage()._cdata for p in meta.parameters()}
    seen_storages = {}  # storage key -> the tensor, kept alive: a freed storage's address may be reused
    sdpa_shapes = []
    extra_bwd = [0]
    n_ops = {"fwd": 0, "bwd": 0}
    _skip = {torch.ops.aten.detach.default, torch.ops.aten._local_scalar_dense.default}

    def on_op(func):
        if func in _skip:
            return
        if phase["bwd"]:
            n_ops["bwd"] += 1
            return
        n_ops["fwd"] += 1
        owner = stack[-1] if stack else ""
        if owner in mods:
            mods[owner].ops += 1
    linear_inputs, module_input_id = {}, {}
    phase = {"bwd": False, "sdpa": False}
    from hyper_parallel.auto.selective_ac import SAVE_OPS

    def on_out(func, out):  # what selective AC keeps: matmul outputs (attention's own are added by the spy)
        if phase["bwd"] or phase["sdpa"] or not isinstance(out, torch.Tensor):
            return
        owner = stack[-1] if stack else ""
        if owner not in mods:
            return
        if func in SAVE_OPS:
            mods[owner].sac_bytes += out.numel() * out.element_size()
        elif not getattr(func, "is_view", False):  # memory-bound op: writes its output (the cost model's HBM term)
            mods[owner].ew_bytes += out.numel() * out.element_size()

    def pre(mod, args):
        n = names.get(mod)
        if n is None or phase["bwd"]:
            return
        t = mods[n]
        t.calls += 1
        t.n_args = len(args)
        if args and isinstance(args[0], torch.Tensor):
            module_input_id[n] = id(args[0])
            if isinstance(mod, nn.Linear):
                linear_inputs[n] = id(args[0])
        parent = n.rsplit(".", 1)[0] if "." in n else ""
        if isinstance(mod, nn.Linear):
            for anc in _ancestors(n):
                if anc in mods:
                    mods[anc].linear_order.append(n)
        stack.append(n)

    def post(mod, args, out):
        n = names.get(mod)
        if n is None or phase["bwd"]:
            return
        if stack and stack[-1] == n:
            stack.pop()

    def pack(tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "meta":
            return tensor
        try:
            key = tensor.untyped_storage()._cdata
            nbytes = tensor.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001 - tensor subclasses without storage
            key, nbytes = id(tensor), tensor.numel() * tensor.element_size()
        if key in param_storages or key in seen_storages:
            return tensor
        seen_storages[key] = tensor
        owner = stack[-1] if stack else ""
        if owner in mods:
            mods[owner].saved_bytes += nbytes
        else:
            mods.setdefault("", ModuleTrace("", "root")).saved_bytes += nbytes
        return tensor

    class _SdpaSpy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not phase["bwd"] and stack and getattr(func, "__name__", "") not in _METADATA:
                mods[stack[-1]].tf_ops += 1
            if func is F.scaled_dot_product_attention and not phase["bwd"]:
                q, k = args[0], args[1]
                sdpa_shapes.append((tuple(q.shape), tuple(k.shape)))
                # a causal / sliding-window kernel (flash) computes only the (query, key) pairs the mask keeps
                b, h, s, d = q.shape
                full = 4 * b * h * s * k.shape[-2] * d
                done = int(full * _mask_fraction(s, k.shape[-2], kwargs, args, [mods_obj.get(n) for n in stack]))
                if stack:
                    mods[stack[-1]].sdpa_skipped += full - done
                for anc in reversed(stack):
                    t = mods[anc]
                    if t.linear_order:
                        if t.sdpa_at is None:
                            t.sdpa_at = len(t.linear_order)
                        t.sdpa_flops += done
                        break
                # fused (flash / memory-efficient) attention, as real CPU and GPU runs use: it keeps q, k, v,
                # the output and a float32 log-sum-exp [B, H, S] for backward, never the [S, S] scores
                extra_bwd[0] += 2 * done  # dq, dk, dv (+ recomputed scores)
                phase["sdpa"] = True
                try:
                    with torch.no_grad():
                        out = func(*args, **kwargs)
                finally:
                    phase["sdpa"] = False
                if stack and stack[-1] in mods:  # selective AC saves the attention output and its log-sum-exp
                    mods[stack[-1]].sac_bytes += out.numel() * out.element_size() + b * h * s * 4
                return _FusedAttention.apply(out, args[0], args[1], args[2])
            return func(*args, **kwargs)

    def on_eager_scores(q_shape, k_shape):  # eager attention (eager_attention): the first q @ k^T of a module
        for anc in reversed(stack):
            t = mods[anc]
            if t.linear_order:
                if t.sdpa_at is None:
                    t.sdpa_at = len(t.linear_order)
                    sdpa_shapes.append((q_shape, k_shape))
                    b, h, s, d = q_shape
                    t.sdpa_flops += 4 * b * h * s * k_shape[-2] * d
                return

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post)
    try:
        fwd_counter = FlopCounterMode(display=False)
        with _MetaDataDependent(on_op, on_out), fwd_counter, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
                _SdpaSpy(), EagerAttentionSpy(on_eager_scores, lambda: not phase["bwd"] and not phase["sdpa"]):
            lval = loss_of(call_model(meta, batch, seq_len, example_input), loss)
        phase["bwd"] = True
        bwd_counter = FlopCounterMode(display=False)
        with _MetaDataDependent(on_op), bwd_counter:
            lval.backward()
    finally:
        h1.remove()
        h2.remove()
    bwd_total = bwd_counter.get_total_flops() + extra_bwd[0]
    _assign_flops(mods, fwd_counter, "fwd_flops", meta)
    _assign_flops(mods, bwd_counter, "bwd_flops", meta)
    skipped = 0
    for f, t in list(mods.items()):  # the masked-out attention pairs: off the module and all its ancestors
        if t.sdpa_skipped:
            skipped += t.sdpa_skipped
            for anc in list(_ancestors(f)) + [f]:
                if anc in mods:
                    mods[anc].fwd_flops -= t.sdpa_skipped
    saved = sum(t.saved_bytes for t in mods.values())
    return Trace(batch, seq_len, mods, fwd_counter.get_total_flops() - skipped, bwd_total, saved,
                 sdpa_shapes, {n: t.n_args for n, t in mods.items()}, linear_inputs, module_input_id,
                 n_ops["fwd"], n_ops["bwd"])


def _mask_fraction(s_q: int, s_k: int, kwargs, args, stack_modules) -> float:
    """Fraction of the ``s_q x s_k`` (query, key) pairs a fused kernel computes: 1 for full attention,
    about 1/2 causal (``is_causal=True``, or a mask tensor in a module whose ``is_causal`` is True, as Hugging
    Face's attention modules say), ``w / s_k`` for a sliding window of ``w`` (a ``sliding_window`` int on the
    attention module, Hugging Face's convention)."""
    causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
    window = None
    for m in reversed(stack_modules):
        if m is None:
            continue
        w = getattr(m, "sliding_window", None)
        if isinstance(w, int) and not isinstance(w, bool) and w > 0:
            window = w
        if not causal and getattr(m, "is_causal", False) is True and (kwargs.get("attn_mask") is not None
                                                                       or (len(args) > 3 and args[3] is not None)):
            causal = True
        if window or causal:
            break
    if not causal and window is None:
        return 1.0
    off = s_k - s_q  # queries are the last s_q positions of the keys
    pairs = 0
    w = window or s_k
    # query i (0-based) sees keys max(0, i + off - w + 1) .. i + off: min(i + off + 1, w) of them
    full_rows = max(0, min(s_q, w - off - 1))   # rows before the window is full: i + off + 1 < w
    pairs += full_rows * (2 * (off + 1) + full_rows - 1) // 2  # off+1, off+2, ... keys
    pairs += (s_q - full_rows) * w
    return min(1.0, pairs / float(s_q * s_k))


def _ancestors(fqn: str):
    parts = fqn.split(".")
    yield ""
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


def _assign_flops(mods, counter, attr, root):
    """FlopCounterMode counts per module path (root class name first); keep each module's inclusive total."""
    counts = counter.get_flop_counts()
    root_name = type(root).__name__
    for key, ops in counts.items():
        if key == "Global":
            continue
        fqn = key[len(root_name) + 1:] if key.startswith(root_name + ".") else ("" if key == root_name else None)
        if fqn is None or fqn not in mods:
            continue
        setattr(mods[fqn], attr, getattr(mods[fqn], attr) + int(sum(ops.values())))


def _all_meta(model):
    return all(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))


def _shallow_meta_copy(model):
    return copy.deepcopy(model)
