"""The parameter groups of one ``fully_shard`` module whose parameters live on several dp meshes.

``fully_shard(block, mesh=fsdp, shard_placement_fn=fn)`` where ``fn`` returns
``ShardPlacementResult(mesh_info=FSDPMeshInfo(efsdp))`` for the experts (``fsdp/mesh_info.py``)
gives the block parameters on two dp meshes. As torch 2.13 does (``_init_param_group``: one
``FSDPParamGroup`` per shard/replicate process group in the module's one state), each mesh gets
its own :class:`~hyper_parallel.fsdp.param_group.FSDPParamGroup` (its own flat all_gather and
reduce_scatter on its own process group), and each divides its gradients by its own
data-parallel size, unless ``set_gradient_divide_factor`` gave one factor (which then applies to
every group, as in torch).

:class:`MeshGroups` presents those groups to ``fsdp/state.py`` as one group: the state's hooks
call the same methods, which act on every sub-group in a fixed order (the same on every rank, so
each process group sees its collectives in one order); all_gathers are issued for all of them
before any is waited on. The module's post-backward runs once the last expected gradient of the
last sub-group has arrived.
"""
from __future__ import annotations

from hyper_parallel.fsdp.param_group import SHARDED, UNSHARDED, UNSHARDING


class MeshGroups:
    """Several ``FSDPParamGroup`` (one per dp mesh) behind the one-group interface ``FSDPState`` uses."""

    def __init__(self, groups):
        self.groups = list(groups)
        self.params = [p for g in self.groups for p in g.params]
        self.on_all_grads = None
        self._waiting = None  # ids of the sub-groups whose expected gradients have not all arrived
        for g in self.groups:
            g.on_all_grads = (lambda g=g: self._sub_ready(g))

    # ------------------------------------------------------------------ settings (every sub-group)
    def _get(self, name):
        return getattr(self.groups[0], name)

    def _set(self, name, value):
        for g in self.groups:
            setattr(g, name, value)

    divide_factor = property(lambda self: self._get("divide_factor"), lambda self, v: self._set("divide_factor", v))
    requires_all_reduce = property(lambda self: self._get("requires_all_reduce"),
                                   lambda self, v: self._set("requires_all_reduce", v))
    grad_reduce = property(lambda self: self._get("grad_reduce"), lambda self, v: self._set("grad_reduce", v))

    @property
    def state(self):
        states = [g.state for g in self.groups]
        if UNSHARDING in states:
            return UNSHARDING
        return SHARDED if all(s == SHARDED for s in states) else UNSHARDED

    @property
    def device(self):
        return self.groups[0].device

    def make_persistent(self):
        for g in self.groups:
            g.make_persistent()

    # ------------------------------------------------------------------ all_gather
    def unshard(self, async_op: bool = True):
        for g in self.groups:
            g.unshard(async_op=True)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self):
        for g in self.groups:  # every all_gather in flight before the first wait
            g.unshard(async_op=True)
        for g in self.groups:
            g.wait_for_unshard()

    def reshard(self):
        for g in self.groups:
            g.reshard()

    # ------------------------------------------------------------------ post-backward tracking
    def expect_grads(self):
        waiting = {id(g) for g in self.groups if g.expect_grads()}
        self._waiting = waiting or None
        return bool(waiting)

    def _sub_ready(self, sub_group):
        w = self._waiting
        if w is None or id(sub_group) not in w:
            return
        w.discard(id(sub_group))
        if not w:
            self._waiting = None
            if self.on_all_grads is not None:
                self.on_all_grads()

    @property
    def expected(self):
        return self._waiting

    @expected.setter
    def expected(self, value):
        if value is not None:
            raise ValueError("MeshGroups.expected can only be cleared (set to None)")
        self._waiting = None
        for g in self.groups:
            g.expected = None

    # ------------------------------------------------------------------ reductions
    def reduction_pending(self) -> bool:
        return any(g.reduction_pending() for g in self.groups)

    def reduce_grads(self):
        for g in self.groups:
            g.reduce_grads()

    def release_send_buffer(self):
        for g in self.groups:
            g.release_send_buffer()

    def start_replica_reduce(self):
        for g in self.groups:
            g.start_replica_reduce()

    def finish_reduce(self):
        for g in self.groups:
            g.finish_reduce()


def group_by_mesh(fsdp_params):
    """``FSDPParam`` lists, one per (shard group, replicate group), in the order of first appearance."""
    by_key = {}
    for fp in fsdp_params:
        rep = fp.rep_group
        key = (tuple(fp.shard_group.ranks), tuple(rep.ranks) if rep is not None else None)
        by_key.setdefault(key, []).append(fp)
    return list(by_key.values())


__all__ = ["MeshGroups", "group_by_mesh"]
