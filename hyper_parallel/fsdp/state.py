"""Per-module FSDP state, forward/backward hooks and the root's end-of-backward callback.

Life of one training step (root R, blocks B0..Bn each ``fully_shard``-ed):

* forward pre-hook of a module: the first FSDP module to run forward becomes
  the root and adopts every FSDP module below it (one shared context). The
  module's group is unsharded (waiting on a prefetched all_gather if one is in
  flight), then the groups to prefetch are issued asynchronously: the ones set
  with ``set_modules_to_forward_prefetch``, else the next module in the forward
  order recorded on the first step (implicit prefetch), so the next all_gather
  runs while this module computes.
* forward post-hook: reshard when ``reshard_after_forward`` (default: every
  module but the root), and hook the outputs' gradients.
* the first output-gradient hook of a module in backward is its pre-backward:
  re-gather if resharded, note which parameters the running backward will
  accumulate into, and prefetch the previous module's group.
* when the last of those gradients has accumulated, the group's gradients are
  reduce-scattered asynchronously (one collective) and the group reshards.
* the root's end-of-backward callback handles modules whose gradients never
  arrived, waits on every reduce_scatter and adds the averaged rows to the
  sharded gradients, which the optimizer then steps.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.distributed import deferred_grads
from hyper_parallel.compile.compile_mode import eager_hook
from hyper_parallel.fsdp.param import FSDPParam
from hyper_parallel.fsdp.param_group import SHARDED, UNSHARDING, FSDPParamGroup
from hyper_parallel.fsdp.mesh_groups import MeshGroups, group_by_mesh


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Ctx:
    """State shared by a root and every FSDP module under it."""

    def __init__(self):
        self.states = []
        self.order = []          # forward order of states (recorded on the first step)
        self.recording = True
        self.callback_queued = False
        self.is_last_backward = True
        self.pending = []        # groups whose reductions a backward with is_last_backward=False left in flight
        self.inflight_rs = None  # the group whose reduce_scatter was issued last (its input is still alive)


class FSDPState:
    def __init__(self, module, group, mesh, reshard_after_forward, mp_policy, offload_policy, where, modules=None):
        self.module, self.group, self.mesh = module, group, mesh
        self.modules = list(modules) if modules else [module]  # fully_shard([m1, m2]): one state, one group
        self._fwd_ran = set()
        self.where = where
        self.user_raf = reshard_after_forward
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.mp = mp_policy
        self.offload = offload_policy
        self.ctx = None
        self.is_root = False
        self.forward_prefetch = None
        self.backward_prefetch = None
        self._pre_bw_done = False
        self._post_bw_done = False
        self._wait_for_final = False
        if group is not None:
            group.on_all_grads = self._all_grads_ready

    # --------------------------------------------------------------- settings shared with the group
    @property
    def requires_all_reduce(self):
        return self.group.requires_all_reduce if self.group is not None else True

    @requires_all_reduce.setter
    def requires_all_reduce(self, value):
        if self.group is not None:
            self.group.requires_all_reduce = value

    @property
    def gradient_divide_factor(self):
        return self.group.divide_factor if self.group is not None else None

    @gradient_divide_factor.setter
    def gradient_divide_factor(self, value):
        if self.group is not None:
            self.group.divide_factor = value

    def ctx_set(self, key, value):
        if self.ctx is not None:
            setattr(self.ctx, key, value)
        else:  # before the first forward: the root's context does not exist yet
            self.__dict__.setdefault("_ctx_presets", {})[key] = value

    # --------------------------------------------------------------- root
    def _lazy_init(self):
        ctx = _Ctx()
        for m in (x for top in self.modules for x in top.modules()):
            st = m.__dict__.get("_hp_fsdp_state")
            if st is None or st.ctx is not None:
                continue
            st.ctx = ctx
            st.is_root = st is self
            raf = st.user_raf
            st.reshard_after_forward = (not st.is_root) if raf is None else bool(raf)
            ctx.states.append(st)
        for k, v in self.__dict__.pop("_ctx_presets", {}).items():
            setattr(ctx, k, v)

    # --------------------------------------------------------------- forward
    def pre_forward(self, module, args, kwargs):
        if self.ctx is None:
            self._lazy_init()
        ctx = self.ctx
        backward = _in_backward()
        if ctx.recording and not backward and self not in ctx.order:
            ctx.order.append(self)
        if self.group is not None:
            self.group.wait_for_unshard()
        if not backward and len(self.modules) > 1:
            self._fwd_ran.add(id(module))
        if not backward:
            for st in self._forward_targets():
                st.group.unshard(async_op=True)
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            dt = self.mp.param_dtype
            cast = lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def _forward_targets(self):
        if self.forward_prefetch is not None:
            return [s for s in self.forward_prefetch if s.group is not None]
        ctx = self.ctx
        if ctx.recording:
            return []
        try:
            i = ctx.order.index(self)
        except ValueError:
            return []
        for st in ctx.order[i + 1:]:
            if st.group is not None:
                return [st] if st.group.state == SHARDED else []
        return []

    def post_forward(self, module, args, kwargs, output):
        backward = _in_backward()
        # a group of several modules reshards after the last of them ran forward
        last_of_group = True
        if len(self.modules) > 1 and not backward:
            last_of_group = len(self._fwd_ran) >= len(self.modules)
            if last_of_group:
                self._fwd_ran = set()
        # without grad no backward will need the parameters: free them (an optimizer step may come next)
        if self.group is not None and (self.reshard_after_forward or not torch.is_grad_enabled()) and not backward \
                and last_of_group:
            self.group.reshard()
        if self.is_root and not backward:
            self.ctx.recording = False
        if torch.is_grad_enabled():
            flat, _ = tree_flatten(output)
            for t in flat:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    local = t._local_tensor if isinstance(t, DTensor) else t
                    if local.grad_fn is not None:
                        local.register_hook(self._pre_backward_hook)
        if self.mp.output_dtype is not None:
            dt = self.mp.output_dtype
            output = tree_map(lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                              output)
        return output

    # --------------------------------------------------------------- backward
    def _pre_backward_hook(self, grad):
        self.pre_backward()
        return None

    def pre_backward(self):
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)
        if self._pre_bw_done:
            return
        self._pre_bw_done = True
        if self.group is not None:
            self.group.wait_for_unshard()
            self.group.expect_grads()
        targets = self._backward_targets()
        prev = ctx.inflight_rs
        if targets and prev is not None and prev is not self.group:
            # land the last reduce_scatter (drop its packed input) before the prefetch's buffers exist:
            # the two never coexist with this module's backward
            with torch.no_grad():
                prev.release_send_buffer()
        for st in targets:
            st.group.unshard(async_op=True)

    def _backward_targets(self):
        if self.backward_prefetch is not None:
            return [s for s in self.backward_prefetch if s.group is not None]
        order = self.ctx.order
        try:
            i = order.index(self)
        except ValueError:
            return []
        if i == 0:  # the root: its output's gradient arrives first; the last module in forward runs backward next
            i = len(order)
        for st in reversed(order[:i]):
            if st is self:
                continue
            if st.group is not None and not st._post_bw_done:
                return [st] if st.group.state == SHARDED and st._will_run_backward() else []
        return []

    def _will_run_backward(self):
        return any(p.is_unsharded_allocated() or p.unsharded is not None for p in self.group.params)

    def _all_grads_ready(self):
        """Every expected gradient has accumulated: reduce now, unless one still waits for a partial sum.

        A TP-replicated parameter used on sequence-sharded activations (SP norm
        weights) gets its tensor-parallel sum at the end of backward
        (``deferred_grads``); such a group is reduced in the root's final callback,
        after that sum.
        """
        summed = deferred_grads.pending_sums(torch._C._current_graph_task_id())
        if summed and any(id(p.unsharded) in summed for p in self.group.params):
            self._wait_for_final = True
            return
        self.post_backward()

    def post_backward(self):
        if self._post_bw_done:
            return
        self._post_bw_done = True
        g = self.group
        if g is None:
            return
        g.expected = None
        # reshard first, as FSDP2 does: the unsharded parameters are freed before the gradients are
        # packed (their .grad stays on the unsharded tensors), so they never coexist with the packed copy
        if self.reshard_after_backward:
            g.reshard()
        if self.requires_gradient_sync:
            ctx = self.ctx
            prev = ctx.inflight_rs if ctx is not None else None
            if prev is not None and prev is not g:
                with torch.no_grad():
                    prev.release_send_buffer()  # free its packed input before packing ours
            g.reduce_grads()
            if ctx is not None:
                ctx.inflight_rs = g

    def _final_callback(self):
        ctx = self.ctx
        order = ctx.order + [s for s in ctx.states if s not in ctx.order]
        deferred_grads.flush(torch._C._current_graph_task_id())  # TP partial sums first (see _all_grads_ready)
        for st in reversed(order):
            if not st._post_bw_done and (st._pre_bw_done or (st.group is not None and st.group.state != SHARDED)):
                st.post_backward()
        with torch.no_grad():
            groups = [st.group for st in reversed(order) if st.group is not None]
            if ctx.is_last_backward:
                # FSDP2: the last backward waits for every reduction, including those left pending
                groups = ctx.pending + [g for g in groups if all(g is not p for p in ctx.pending)]
                ctx.pending = []
                for g in groups:
                    g.start_replica_reduce()
                for g in groups:
                    g.finish_reduce()
                for st in order:  # an all_gather prefetched but never used: finish it and free
                    if st.group is not None and st.group.state == UNSHARDING:
                        st.group.reshard()
            else:
                # not the last backward: leave the reductions in flight (finished by the last backward,
                # or by the group's next reduction)
                for g in groups:
                    if g.reduction_pending() and all(g is not p for p in ctx.pending):
                        ctx.pending.append(g)
        for st in order:
            st._fwd_ran = set()
            st._pre_bw_done = st._post_bw_done = False
        ctx.callback_queued = False
        ctx.inflight_rs = None

    # --------------------------------------------------------------- public
    def reshard(self):
        if self.group is not None:
            self.group.reshard()


# ======================================================================= fully_shard
_CLASS_CACHE = {}


def fully_shard(module, *, mesh, params, reshard_after_forward, mp_policy, offload_policy, module_cls,
                _grad_reduce="reduce_scatter", _persistent=False):
    """Carry out the plan of ``hyper_parallel.fsdp.api`` (which validated every argument).

    ``params``: ``[(fqn, [(owner module, attribute name), ...], param, shard dim[, dp mesh])]``, the
    parameters this module's group manages, in order (a parameter's own dp mesh, when given,
    replaces ``mesh``: one group per mesh); ``mesh``: the resolved 1-D or 2-D
    mesh; ``module_cls``: the mixin the module's class gets (``FSDPModule`` / ``HSDPModule``).
    """
    mods = list(module) if isinstance(module, (list, tuple)) else [module]
    where = type(module).__name__ if len(mods) == 1 and not isinstance(module, (list, tuple)) else \
        "[" + ", ".join(type(m).__name__ for m in mods) + "]"
    fsdp_params = []
    for fqn, owners, p, d, *p_mesh in params:
        pin = getattr(offload_policy, "pin_memory", None)  # set only by CPUOffloadPolicy
        fp = FSDPParam(p, fqn, owners, p_mesh[0] if p_mesh else mesh, d, mp_policy, offload_pin_memory=pin)
        try:
            p._hp_fsdp_owner = f"{where} (parameter {fqn!r})"
        except (AttributeError, RuntimeError):
            pass
        fsdp_params.append(fp)
        fp.to_sharded()
    # one group per dp mesh (shard_placement_fn's ShardPlacementResult): see fsdp/mesh_groups.py
    by_mesh = group_by_mesh(fsdp_params)
    if len(by_mesh) > 1:
        group = MeshGroups([FSDPParamGroup(ps) for ps in by_mesh])
    else:
        group = FSDPParamGroup(fsdp_params) if fsdp_params else None
    if group is not None:
        group.grad_reduce = _grad_reduce
        if _persistent:
            group.make_persistent()
    for fp in fsdp_params:
        fp._full_local_for_zero = None  # drop the reference to the unsharded original
    if group is not None:
        # state_dict() / load_state_dict() see the sharded DTensors even while the group is unsharded
        # (the root after forward), as FSDP2's pre-hooks arrange
        hook = lambda *a, **k: group.reshard()
        for owner in {id(m): m for fp in fsdp_params for m, _ in fp.owners}.values():
            owner.register_state_dict_pre_hook(hook)
            owner._register_load_state_dict_pre_hook(hook)
    state = FSDPState(mods[0], group, mesh, reshard_after_forward, mp_policy, offload_policy, where, modules=mods)
    for m in mods:
        m.__dict__["_hp_fsdp_state"] = state
        # the hooks stay eager when the module is compiled (per-block torch.compile): see eager_hook
        m.register_forward_pre_hook(eager_hook(state.pre_forward), prepend=True, with_kwargs=True)
        m.register_forward_hook(eager_hook(state.post_forward), with_kwargs=True)
        cls = type(m)
        new_cls = _CLASS_CACHE.get((cls, module_cls))
        if new_cls is None:
            prefix = module_cls.__name__[:4]  # FSDP<Class> (fully_shard) or HSDP<Class> (hsdp)
            new_cls = _CLASS_CACHE[(cls, module_cls)] = type(f"{prefix}{cls.__name__}", (module_cls, cls), {})
        m.__class__ = new_cls
    return module


def replicate_small(params, world_mesh, grad_scale=1.0):
    """hsdp's replicated (plain) parameters: each gradient summed over ``world_mesh``, times ``grad_scale``.

    HyperParallel's convention (``HSDPGradHook``): a plain sum, not a mean.
    """
    group = world_mesh.get_comm_group(0)
    for p in params:
        if getattr(p, "_hp_hsdp_replicated", False) or not p.requires_grad:
            continue
        p._hp_hsdp_replicated = True
        if group.size == 1:
            if grad_scale != 1.0:
                p.register_hook(lambda g, s=grad_scale: g * s)
            continue
        deferred_grads.sum_incoming_grads(p, group, grad_scale)


def scale_grads(params, grad_scale):
    """Multiply every gradient backward brings to these (DTensor) parameters by ``grad_scale``."""
    for p in params:
        if getattr(p, "_hp_hsdp_scaled", False) or not p.requires_grad or grad_scale == 1.0:
            continue
        p._hp_hsdp_scaled = True
        local = p._local_tensor if isinstance(p, DTensor) else p
        local.register_hook(lambda g, s=grad_scale: g * s)
