"""PyTorch's names for collectives, mapped to hyper_parallel's collective kinds.

``torch.distributed.tensor.debug.CommDebugMode`` keys its counts by op packets
(``torch.ops.c10d_functional.all_gather_into_tensor``...), and user code often
indexes them with the functional-collective Python functions (``funcol.all_reduce``).
hyper_parallel counts collectives by kind string (``"all_gather"``); this table
lets :class:`hyper_parallel.debug.CommDebugMode` answer those torch keys too, so
code written against torch's mode runs unchanged.
"""
from __future__ import annotations

import torch

from hyper_parallel.distributed import comm_record as rec

# kind -> names under torch.ops.{c10d_functional,_c10d_functional,_c10d_functional_autograd}
_FUNCTIONAL = {
    rec.ALL_GATHER: ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"),
    rec.ALL_REDUCE: ("all_reduce", "all_reduce_coalesced"),
    rec.REDUCE_SCATTER: ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"),
    rec.ALL_TO_ALL: ("all_to_all_single",),
    rec.BROADCAST: ("broadcast",),
}
# kind -> names under torch.ops.c10d (the in-place process-group ops)
_C10D = {
    rec.ALL_GATHER: ("allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"),
    rec.ALL_REDUCE: ("allreduce_", "allreduce_coalesced_"),
    rec.REDUCE_SCATTER: ("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"),
    rec.ALL_TO_ALL: ("alltoall_", "alltoall_base_"),
    rec.BROADCAST: ("broadcast_",),
    rec.SCATTER: ("scatter_",),
    rec.GATHER: ("gather_",),
    rec.REDUCE: ("reduce_",),
    rec.SEND: ("send",),
    rec.RECV: ("recv_",),
}
# kind -> torch.distributed._functional_collectives Python functions
_FUNCOL = {
    rec.ALL_GATHER: ("all_gather_tensor", "all_gather_tensor_autograd", "all_gather_into_tensor_coalesced"),
    rec.ALL_REDUCE: ("all_reduce", "all_reduce_coalesced"),
    rec.REDUCE_SCATTER: ("reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_coalesced"),
    rec.ALL_TO_ALL: ("all_to_all_single", "all_to_all_single_autograd"),
    rec.BROADCAST: ("broadcast",),
}

_TABLE = None


def _add(table, namespace, names, kind):
    for n in names:
        obj = getattr(namespace, n, None)
        if obj is None:
            continue
        table[obj] = kind
        for ov in getattr(obj, "overloads", lambda: [])():  # OpOverload keys (aten-style .default)
            table[getattr(obj, ov)] = kind


def torch_comm_keys() -> dict:
    """``{torch key object: collective kind}`` for every torch spelling of a collective (built once)."""
    global _TABLE
    if _TABLE is not None:
        return _TABLE
    table = {}
    namespaces = [getattr(torch.ops, ns) for ns in ("c10d_functional", "_c10d_functional",
                                                     "_c10d_functional_autograd")]
    for kind, names in _FUNCTIONAL.items():
        for ns in namespaces:
            _add(table, ns, names, kind)
    for kind, names in _C10D.items():
        _add(table, torch.ops.c10d, names, kind)
    try:
        import torch.distributed._functional_collectives as funcol
    except ImportError:  # pragma: no cover - torch without distributed
        funcol = None
    if funcol is not None:
        for kind, names in _FUNCOL.items():
            for n in names:
                fn = getattr(funcol, n, None)
                if fn is not None:
                    table[fn] = kind
    # the torch.distributed eager API functions, for completeness
    import torch.distributed as dist
    for kind, fn in ((rec.ALL_GATHER, "all_gather_into_tensor"), (rec.ALL_GATHER, "all_gather"),
                     (rec.ALL_REDUCE, "all_reduce"), (rec.REDUCE_SCATTER, "reduce_scatter_tensor"),
                     (rec.ALL_TO_ALL, "all_to_all_single"), (rec.BROADCAST, "broadcast"),
                     (rec.SCATTER, "scatter"), (rec.GATHER, "gather"), (rec.REDUCE, "reduce")):
        f = getattr(dist, fn, None)
        if f is not None:
            table.setdefault(f, kind)
    _TABLE = table
    return table


def module_tracker():
    """A context manager that knows the modules running now (``parents``, ``is_bw``), or None.

    Names follow torch's CommDebugMode: ``"Global"`` and ``"<RootClass>.<child>..."``. It
    also notes each running module's parameters (``parameter_info``) and the placements
    of its DTensor parameters (``sharding_info``, keyed ``"<module>.<param>"``).
    """
    try:
        from torch.distributed._tools.mod_tracker import ModTracker
    except ImportError:  # pragma: no cover
        return None

    class _Tracker(ModTracker):
        # A module leaves ``parents`` in a forward hook of its own, registered on first use and
        # so run after the hooks already on it (a parallel style's output redistribution): as in
        # torch's CommDebugMode, those collectives count for the module.
        def __init__(self):
            super().__init__()
            self.parameter_info = {}
            self.sharding_info = {}
            self._late = {}

        def _fw_post_hook(self, mod, input, output):
            if mod not in self._late:  # a module first seen here (no pre-hook ran): pop now
                ModTracker._fw_post_hook(self, mod, input, output)

        def _late_post_hook(self, mod, input, output):
            ModTracker._fw_post_hook(self, mod, input, output)

        def __exit__(self, *args):
            super().__exit__(*args)
            for h in self._late.values():
                h.remove()
            self._late.clear()

        def _fw_pre_hook(self, mod, input):
            super()._fw_pre_hook(mod, input)
            if mod not in self._late:
                self._late[mod] = mod.register_forward_hook(self._late_post_hook, always_call=True)
            if self.is_bw:  # re-run under activation checkpointing: already noted
                return
            name = self._get_mod_name(mod)
            for pname, p in mod.named_parameters(recurse=False):
                self.parameter_info.setdefault(name, {})[pname] = p.data
                placements = getattr(p, "placements", None)
                if placements is not None:
                    self.sharding_info[f"{name}.{pname}"] = placements

    return _Tracker()
