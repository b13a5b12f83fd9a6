"""SDPA interception: every way an ``F.scaled_dot_product_attention`` call becomes context-parallel attention.

Why one module: under context parallelism each rank holds one shard of the sequence, so an attention
computed on it alone is silently wrong. The library therefore takes over the user's SDPA calls, and
the three routes by which it does so must agree on the same checks (no ``attn_mask`` tensor, no
dropout, GQA only with ``enable_gqa``) and the same masks. They live here, side by side:

1. **Eager, plain tensors** (``ContextParallel`` style, torch's ``context_parallel`` context
   manager): a ``TorchFunctionMode`` (:class:`SDPAMode`) sees every call of
   ``torch.nn.functional.scaled_dot_product_attention`` while it is active and hands it to a handler
   (:func:`sdpa_handler`); every other function runs unchanged. ``context_parallel`` keeps the mode
   active for its ``with`` block; the style activates it around its module's forward only
   (:func:`hook_module`: a pre-hook and a forward hook that always runs). :class:`attention_mask`
   supplies the document / sliding-window mask SDPA has no argument for.
2. **torch.compile**: dynamo cannot trace the planning (it reads the ``DeviceMesh``) nor the ring's
   point-to-point sends, so while compiling the handler emits one call of the custom op
   ``hyper_parallel_cp::sdpa(query, key, value, handler_id, is_causal, scale, enable_gqa)``: a single
   graph node, no graph break. ``handler_id`` names the eager handler registered when the style was
   applied; the op runs it eagerly. Backward is a second op, ``hyper_parallel_cp::sdpa_backward``, that
   runs the handler again with autograd on and takes ``torch.autograd.grad`` of it (the forward
   attention is recomputed once; exact, same collectives as eager). Under compile the
   ``attention_mask(...)`` context is not supported (the op would not see it in backward) and raises.
3. **DTensor op dispatch** (torch's private ``_enable_context_parallel_dispatcher``, torchtitan):
   while enabled, SDPA on DTensors whose sequence dim is ``Shard`` on a cp group runs ring attention
   in the sequence order recorded for that group (:mod:`.order`); everything else goes to the rule
   that served SDPA before. Its public names are re-exported by :mod:`.torch_private`.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hyper_parallel.context_parallel import api as _api
from hyper_parallel.context_parallel.api import context_parallel_attention
from hyper_parallel.context_parallel.masks import CausalMask, NoMask, as_mask
from hyper_parallel.context_parallel.order import recorded
from hyper_parallel.dispatch.rules.base import (DistributedOp, Strategy, bind_args, get_rule, is_dtensor,
                                              override)

_SDPA = F.scaled_dot_product_attention
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


# --- route 1: the function mode, module hooks and the mask context --------------------------------------------

class SDPAMode(TorchFunctionMode):
    """Hands every ``F.scaled_dot_product_attention`` call to ``handler`` while active; counts them."""

    def __init__(self, handler):
        super().__init__()
        self.handler = handler
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            self.calls += 1
            return self.handler(*args, **kwargs)
        return func(*args, **kwargs)


def hook_module(module, handler, what=None):
    """Make ``module``'s SDPA calls go to ``handler`` during its forward; returns the hook handles.

    With ``what`` (the style's name), a forward of ``module`` that ran no SDPA call raises: its attention
    was computed some other way (an eager softmax, a fused kernel) on this rank's sequence shard only,
    which would be silently wrong under context parallelism."""
    state = []

    def pre(mod, args, kwargs):
        mode = SDPAMode(handler)
        mode.__enter__()
        state.append(mode)

    def post(mod, args, kwargs, out):
        if state:
            mode = state.pop()
            mode.__exit__(None, None, None)
            if what is not None and mode.calls == 0 and not torch.compiler.is_compiling():
                raise RuntimeError(
                    f"{what} on {type(mod).__name__}: its forward ran no F.scaled_dot_product_attention call, so its "
                    "attention saw only this rank's sequence shard (a wrong result under context parallelism). "
                    "Compute the attention with F.scaled_dot_product_attention (Hugging Face models: "
                    "attn_implementation='sdpa'), or apply ContextParallel to the module that calls it")

    pre_handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    post_handle = module.register_forward_hook(post, with_kwargs=True, always_call=True)
    return pre_handle, post_handle


_MASK = threading.local()


class attention_mask:
    """``with attention_mask(DocumentMask(...)):`` - the mask intercepted ``F.scaled_dot_product_attention``
    calls (``ContextParallel``, ``context_parallel``) use when they pass neither ``attn_mask`` nor
    ``is_causal`` (SDPA has no argument for a document or sliding-window mask)."""

    def __init__(self, mask):
        self.mask = as_mask(mask, "attention_mask")

    def __enter__(self):
        stack = getattr(_MASK, "stack", None)
        if stack is None:
            stack = _MASK.stack = []
        stack.append(self.mask)
        return self.mask

    def __exit__(self, *exc):
        _MASK.stack.pop()
        return False


def _active_mask():
    stack = getattr(_MASK, "stack", None)
    return stack[-1] if stack else None


def sdpa_handler(mesh, method, load_balance, rotate=None, what="context-parallel SDPA"):
    """A handler for intercepted ``F.scaled_dot_product_attention(query, key, value, ...)`` calls on ``mesh``.

    Eagerly it runs :func:`~.api.context_parallel_attention`; while dynamo traces it emits the opaque op
    (route 2), which runs the same eager function at run time."""

    def handler(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if torch.compiler.is_compiling():
            # torch.compile: one opaque op (no DeviceMesh or p2p in the traced region); it runs `eager`
            _check(attn_mask, dropout_p, query, key, enable_gqa)
            return sdpa(query, key, value, handler_id, bool(is_causal), None if scale is None else float(scale),
                        bool(enable_gqa))
        return eager(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def _check(attn_mask, dropout_p, query, key, enable_gqa):
        if dropout_p:
            raise NotImplementedError(f"{what}: dropout_p={dropout_p} > 0 is not supported under context "
                                      "parallelism (expected dropout_p=0.0)")
        _check_mask_gqa(attn_mask, query, key, enable_gqa)

    def _check_mask_gqa(attn_mask, query, key, enable_gqa):
        if attn_mask is not None:
            raise NotImplementedError(
                f"{what}: an attn_mask tensor cannot be honoured under context parallelism (each rank holds a "
                "sequence shard; a dense mask is never silently dropped); use is_causal=True, or "
                "hyper_parallel.context_parallel.attention_mask(DocumentMask(...) | SlidingWindowMask(w))")
        q_heads, kv_heads = query.shape[-3], key.shape[-3]
        if q_heads != kv_heads and not enable_gqa:
            raise ValueError(f"{what}: query has {q_heads} heads and key/value {kv_heads}; pass enable_gqa=True for "
                             "grouped-query attention (as F.scaled_dot_product_attention requires)")

    def eager(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              compiled=False):
        _check_mask_gqa(attn_mask, query, key, enable_gqa)
        extra = _active_mask()
        if compiled and extra is not None and not isinstance(extra, NoMask):
            raise NotImplementedError(f"{what}: attention_mask({extra!r}) is not supported inside torch.compile "
                                      "(the compiled context-parallel SDPA op supports is_causal=True or no mask); "
                                      "run this attention eagerly")
        if extra is not None and not isinstance(extra, NoMask):
            if is_causal and not extra.causal:
                raise ValueError(f"{what}: is_causal=True contradicts the active non-causal mask {extra!r}")
            mask = extra
        else:
            mask = CausalMask() if is_causal else NoMask()
        return context_parallel_attention(query, key, value, mesh, method=method, mask=mask, scale=scale,
                                          load_balance=load_balance, rotate=rotate, dropout_p=dropout_p)

    handler_id = register_handler(eager)
    return handler


# --- route 2: one opaque op for torch.compile ---------------------------------------------------------------

_HANDLERS: dict = {}
# how often the ops ran (tests check that compiled blocks went through them)
CALLS = {"forward": 0, "backward": 0}


def register_handler(handler: Callable) -> int:
    """Keep ``handler`` (the eager SDPA handler of one ``ContextParallel`` application); returns its id."""
    handler_id = len(_HANDLERS)
    _HANDLERS[handler_id] = handler
    return handler_id


def _autograd_on():
    """Re-enable autograd dispatch inside a custom op's implementation (which runs below Autograd)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"):
        key = getattr(torch._C.DispatchKey, name, None)
        if key is not None:
            excluded = excluded.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


def _call(handler_id, query, key, value, is_causal, scale, enable_gqa):
    return _HANDLERS[handler_id](query, key, value, None, 0.0, is_causal, scale, enable_gqa, compiled=True)


@torch.library.custom_op("hyper_parallel_cp::sdpa", mutates_args=())
def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, handler_id: int, is_causal: bool,
         scale: Optional[float], enable_gqa: bool) -> torch.Tensor:
    CALLS["forward"] += 1
    with torch.no_grad():
        out = _call(handler_id, query, key, value, is_causal, scale, enable_gqa)
    return out.clone() if out is query or out is key or out is value else out


@sdpa.register_fake
def _sdpa_fake(query, key, value, handler_id, is_causal, scale, enable_gqa):
    return query.new_empty(tuple(query.shape[:-1]) + (value.shape[-1],))


@torch.library.custom_op("hyper_parallel_cp::sdpa_backward", mutates_args=())
def sdpa_backward(dout: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, handler_id: int,
                  is_causal: bool, scale: Optional[float],
                  enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    CALLS["backward"] += 1
    with torch.enable_grad(), _autograd_on():
        leaves = tuple(t.detach().requires_grad_(True) for t in (query, key, value))
        out = _call(handler_id, *leaves, is_causal, scale, enable_gqa)
        grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g.clone(memory_format=torch.contiguous_format)
                 for g, t in zip(grads, (query, key, value)))


@sdpa_backward.register_fake
def _sdpa_backward_fake(dout, query, key, value, handler_id, is_causal, scale, enable_gqa):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup(ctx, inputs, output):
    query, key, value, handler_id, is_causal, scale, enable_gqa = inputs
    ctx.save_for_backward(query, key, value)
    ctx.args = (handler_id, is_causal, scale, enable_gqa)


def _backward(ctx, dout):
    query, key, value = ctx.saved_tensors
    dquery, dkey, dvalue = sdpa_backward(dout.contiguous(), query, key, value, *ctx.args)
    return dquery, dkey, dvalue, None, None, None, None


sdpa.register_autograd(_backward, setup_context=_setup)


# --- route 3: the DTensor op rule behind torch's _enable_context_parallel_dispatcher ------------------------

class _CPSDPARule(DistributedOp):
    """SDPA while the context-parallel dispatcher is on: sequence-sharded DTensors -> ring attention in the
    recorded order; everything else -> the rule that served SDPA before."""

    float_args_matter = True

    def __init__(self, previous):
        super().__init__("scaled_dot_product_attention", register=False)
        self.previous = previous

    def _fallback(self, call):
        if self.previous is None:
            raise NotImplementedError("scaled_dot_product_attention has no DTensor rule")
        return self.previous.strategy(call)

    def strategy(self, call):
        what = "context-parallel SDPA (_enable_context_parallel_dispatcher)"
        bound = bind_args(call.args, call.kwargs, _SDPA_NAMES)
        query, key, value = bound.get("query"), bound.get("key"), bound.get("value")
        if not is_dtensor(query) or not call.layouts:
            return self._fallback(call)
        q_layout, q_shape = call.layouts[0], tuple(call.shapes[0])
        seq = len(q_shape) - 2
        mesh_dims = q_layout.dim_map[seq] if seq >= 0 else ()
        if not mesh_dims:
            return self._fallback(call)
        if not (is_dtensor(key) and is_dtensor(value)) or len(call.layouts) != 3:
            raise NotImplementedError(f"{what}: query, key and value must be DTensors sharded alike and attn_mask "
                                      "must be None (use is_causal=True)")
        if len(mesh_dims) != 1:
            raise NotImplementedError(f"{what}: the query's sequence dim is sharded on mesh dims {mesh_dims}; "
                                      "context parallelism shards it on one cp mesh dim")
        for name, layout in (("key", call.layouts[1]), ("value", call.layouts[2])):
            if layout != q_layout:
                raise ValueError(f"{what}: {name} is laid out as {layout}, query as {q_layout}; key and value must "
                                 "be sharded like the query (the same sequence order)")
        if q_layout.has_partial() or q_layout.dim_map[-1]:
            raise NotImplementedError(f"{what}: query layout {q_layout} has a Partial or a sharded head dim")
        if float(bound.get("dropout_p", 0.0) or 0.0):
            raise NotImplementedError(f"{what}: dropout_p={bound.get('dropout_p')} > 0 is not supported "
                                      "(expected 0.0)")
        mesh_dim, mesh = mesh_dims[0], call.mesh
        v_shape = tuple(call.shapes[2])
        out_shape = q_shape[:-1] + (v_shape[-1],)
        batch_sharded = bool(q_layout.dim_map[0]) if len(q_shape) >= 4 else False

        def local_fn(*args, **kwargs):
            local = bind_args(args, kwargs, _SDPA_NAMES)
            q_local, k_local, v_local = local["query"], local["key"], local["value"]
            group = mesh.get_comm_group(mesh_dim)
            ranks = tuple(group.ranks)
            order = recorded(ranks)
            local_len, cp_index = q_local.shape[-2], group.rank
            if order is None:
                raise RuntimeError(f"{what}: the query is sequence-sharded over the cp group of ranks {list(ranks)}, "
                                   "but no sequence order is recorded for that group, so the positions of the local "
                                   "rows are unknown; shard the inputs with _context_parallel_shard (or cp_shard) "
                                   "first")
            if order.cp != len(ranks) or order.local_len(cp_index) != local_len:
                raise RuntimeError(f"{what}: this rank (cp index {cp_index}) holds {local_len} sequence rows, but the "
                                   f"recorded order {order!r} gives it {order.local_len(cp_index)}; the inputs were "
                                   "not sharded by the last _context_parallel_shard on this cp group")
            if order.batch > 1 and (batch_sharded or q_local.dim() < 4 or q_local.shape[0] != order.batch):
                raise RuntimeError(f"{what}: the recorded order varies along a batch of {order.batch} rows, but the "
                                   f"local query has shape {tuple(q_local.shape)} (batch dim 0 must be whole, of that "
                                   "size)")
            q_heads, kv_heads = q_local.shape[-3], k_local.shape[-3]
            if q_heads != kv_heads and not local.get("enable_gqa", False):
                raise ValueError(f"{what}: query has {q_heads} heads and key/value {kv_heads}; pass enable_gqa=True")
            mask = CausalMask() if local.get("is_causal", False) else NoMask()
            rotate = _api._check_rotate(None, what)
            return _api.run_ordered(q_local, k_local, v_local, order.layouts(), 1, len(ranks), None, group, cp_index,
                                    mask, local.get("scale"), rotate, what)
        return Strategy([q_layout, q_layout, q_layout], q_layout, local_fn=local_fn, out_shapes=out_shape)


_STATE = {"override": None}


def _enable_context_parallel_dispatcher() -> None:
    """Route sequence-sharded DTensor SDPA to context-parallel attention in the recorded order (idempotent)."""
    if _STATE["override"] is None:
        _STATE["override"] = override("scaled_dot_product_attention",
                                      _CPSDPARule(get_rule("scaled_dot_product_attention")))


def _disable_context_parallel_dispatcher() -> None:
    """Undo :func:`_enable_context_parallel_dispatcher` (idempotent)."""
    handle = _STATE["override"]
    if handle is not None:
        _STATE["override"] = None
        handle.undo()


__all__ = ["SDPAMode", "hook_module", "attention_mask", "sdpa_handler", "register_handler", "sdpa", "sdpa_backward",
           "CALLS", "_enable_context_parallel_dispatcher", "_disable_context_parallel_dispatcher"]
