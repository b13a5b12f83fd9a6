"""``ContextParallel``: a ``ParallelStyle`` making a module's ``F.scaled_dot_product_attention`` calls context-parallel."""
from __future__ import annotations

from hyper_parallel.context_parallel import api as _api
from hyper_parallel.context_parallel.sdpa_interception import hook_module, sdpa_handler
from hyper_parallel.dtensor.device_mesh import resolve_mesh
from hyper_parallel.tensor_parallel.style import ParallelStyle


class ContextParallel(ParallelStyle):
    """``parallelize_module(model, cp_mesh, {"layers.*.attention": ContextParallel(method="ring")})``.

    The module keeps its parameters (plain tensors, replicated over the cp ranks, as in PyTorch);
    during its forward every ``F.scaled_dot_product_attention(q, k, v, is_causal=...)`` call on this
    rank's sequence shards (``[..., heads, seq_shard, head_dim]``, laid out by :func:`cp_shard` with the
    same ``load_balance``) computes exact attention over the whole sequence by ``method``:

    * ``"ring"`` (1-D mesh): K/V blocks passed around the ring (rotation: ``set_rotate_method``);
    * ``"ulysses"`` (1-D mesh): all_to_all sequence <-> heads, local attention, all_to_all back;
    * ``"hybrid"`` (2-D mesh): Ulysses over the first mesh dim, ring over the second.

    Masks: ``is_causal`` or none; :class:`~hyper_parallel.context_parallel.attention_mask` for document
    and sliding-window masks; an ``attn_mask`` tensor or ``dropout_p > 0`` raises.
    """

    accepts_nd_mesh = True  # parallelize_module lets a 2-D mesh through for method="hybrid"

    def __init__(self, method: str = "ring", load_balance: bool = True):
        _api._check_method(method, "ContextParallel")
        if not isinstance(load_balance, bool):
            raise TypeError(f"ContextParallel: load_balance must be a bool, got {load_balance!r}")
        self.method = method
        self.load_balance = load_balance

    def apply(self, module, device_mesh):
        what = f"ContextParallel(method={self.method!r})"
        device_mesh = resolve_mesh(device_mesh, what)
        _api._ulysses_ring_groups(device_mesh, self.method, what)   # checks the mesh's axes (and membership) now
        handler = sdpa_handler(device_mesh, self.method, self.load_balance, None, what)
        handles = hook_module(module, handler, what)
        module.__dict__.setdefault("_hp_context_parallel", []).append((self, handles))
        return module


__all__ = ["ContextParallel"]
