"""Expert parallelism on Hugging Face expert modules (``Qwen3MoeExperts``, ``MixtralExperts``, ...).

HF 5.x keeps a layer's routed experts in one module with 3-D parameters (``gate_up_proj [E, 2I, D]``,
``down_proj [E, D, I]``) and ``forward(hidden_states [T, D], top_k_index [T, k], top_k_weights [T, k])``,
which is not torchtitan's GroupedExperts contract that :class:`hyper_parallel.moe.ExpertParallel` wraps.
:class:`HFExpertParallel` shards every 3-D parameter ``Shard(0)`` over the ep mesh and wraps the forward:

1. ``hyper_parallel.moe.dispatch`` sends each (token, expert) assignment to the rank holding the expert;
2. the module's own forward runs on the received rows with this rank's experts (the local pieces of
   the parameters, ``num_experts`` set to the local count), each row routed to its local expert with weight 1;
3. ``hyper_parallel.moe.combine`` brings the rows back and sums them over the top-k with the routing weights.

So the expert math (activation, gating, biases, the ``experts_implementation`` chosen) stays HF's own.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from hyper_parallel.dtensor.api import distribute_tensor
from hyper_parallel.dtensor.device_mesh import resolve_mesh
from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.dtensor.placement_types import Replicate, Shard
from hyper_parallel.tensor_parallel.style import ParallelStyle

_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


def is_hf_experts(module: nn.Module) -> bool:
    """HF's experts contract: 3-D parameters with one leading E and ``forward(hidden_states, top_k_index,
    top_k_weights)``."""
    ps = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    if len(ps) < 2 or len({p.shape[0] for p in ps}) != 1:
        return False
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return names[:3] == list(_ARGS)


class HFExpertParallel(ParallelStyle):
    """``parallelize_module(experts, ep_mesh, HFExpertParallel())`` on a HF experts module (module docstring)."""

    def apply(self, module: nn.Module, device_mesh) -> nn.Module:
        what = f"HFExpertParallel on {type(module).__name__}"
        mesh = resolve_mesh(device_mesh, what)
        if mesh.ndim != 1:
            raise ValueError(f"{what}: the ep mesh must be 1-D, got {mesh}")
        if not is_hf_experts(module):
            raise ValueError(f"{what}: expected 3-D expert parameters [E, ., .] and forward(hidden_states, "
                             "top_k_index, top_k_weights) (Hugging Face's experts modules)")
        E = next(p for p in module.parameters(recurse=False) if p.dim() == 3).shape[0]
        ep = mesh.size()
        if E % ep:
            raise ValueError(f"{what}: {E} experts do not divide over ep={ep} ranks")
        for name, p in list(module.named_parameters(recurse=False)):
            place = [Shard(0)] if p.dim() == 3 else [Replicate()]
            dt = distribute_tensor(p.data, mesh, place, src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        local_forward = module.forward

        def forward(hidden_states, top_k_index, top_k_weights):
            from hyper_parallel.moe import combine, dispatch
            routed, counts, handle = dispatch(hidden_states, top_k_index, mesh, num_experts=E)
            n_local = E // ep
            ids = torch.repeat_interleave(torch.arange(n_local, device=routed.device), counts.to(routed.device),
                                          output_size=routed.shape[0]).unsqueeze(1)
            ones = torch.ones(routed.shape[0], 1, dtype=top_k_weights.dtype, device=routed.device)
            saved = dict(module._parameters)
            saved_e = getattr(module, "num_experts", None)
            try:  # the module's own forward on this rank's experts (local pieces; gradients flow to the DTensors)
                for k, p in saved.items():
                    if isinstance(p, DTensor):
                        module._parameters[k] = p.to_local()
                if saved_e is not None:
                    module.num_experts = n_local
                out = local_forward(routed, ids, ones)
            finally:
                module._parameters.update(saved)
                if saved_e is not None:
                    module.num_experts = saved_e
            return combine(out, handle, top_k_weights.to(out.dtype))

        module.forward = forward
        return module


class AnyExpertParallel(ParallelStyle):
    """Expert parallelism for either kind of experts module: HF's (:class:`HFExpertParallel`) or torchtitan's
    GroupedExperts contract (``hyper_parallel.moe.ExpertParallel``), chosen per module at apply."""

    def apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from hyper_parallel.moe import ExpertParallel
        style = HFExpertParallel() if is_hf_experts(module) else ExpertParallel()
        style.src_data_rank = self.src_data_rank
        return style.apply(module, device_mesh)


__all__ = ["HFExpertParallel", "AnyExpertParallel", "is_hf_experts"]
