"""A stand-in for ``hyper_parallel.moe.ExpertParallel`` (used only when the library lacks it).

Same contract as the library style (torchtitan's): applied to a GroupedExperts module on the ep
mesh, it shards ``w1``/``w2``/``w3`` ``Shard(0)`` and wraps the forward: before it, the token
counts are exchanged (one all_to_all of E ints) and the rows all-to-all'ed to the ranks holding
their experts, then regrouped by local expert; after it, the inverse permutation and the reverse
all_to_all. Both all_to_alls are differentiable (``torch.distributed.nn.functional``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dfn

import hyper_parallel as hp
from hyper_parallel import Shard


class ExpertParallel(hp.ParallelStyle):
    def apply(self, module, device_mesh):
        ep = device_mesh.size()
        n = module.w1.shape[0]
        if n % ep:
            raise ValueError(f"ExpertParallel: {n} experts are not divisible by the ep degree {ep}")
        for name in ("w1", "w2", "w3"):
            p = getattr(module, name)
            d = hp.distribute_tensor(p.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, torch.nn.Parameter(d, requires_grad=p.requires_grad))
        group = device_mesh.get_group()
        state = {}

        def pre(mod, args):
            x, counts = args
            local = n // ep
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=group)  # [ep, local]: each source's counts for my experts
            c = recv.view(ep, local)
            in_splits = counts.view(ep, local).sum(1).tolist()
            out_splits = c.sum(1).tolist()
            out = x.new_empty(sum(out_splits), x.shape[1])
            y = dfn.all_to_all_single(out, x, out_splits, in_splits, group=group)
            expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep), c.reshape(-1))
            order = torch.argsort(expert_of_row, stable=True)
            state.update(order=order, in_splits=in_splits, out_splits=out_splits, rows=x.shape[0])
            return y.index_select(0, order), c.sum(0)

        def post(mod, args, out):
            order = state.pop("order")
            inv = torch.empty_like(order)
            inv[order] = torch.arange(order.numel(), device=order.device)
            back = out.new_empty(state["rows"], out.shape[1])
            return dfn.all_to_all_single(back, out.index_select(0, inv), state["in_splits"], state["out_splits"],
                                         group=group)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module
