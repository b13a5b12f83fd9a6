"""Tensor/sequence/data parallel plan for the example Llama (torchtitan style, one screen).

``parallelize_llama(model, mesh, sequence_parallel=True)`` shards every block
Megatron-style over ``mesh["tp"]`` and, when the mesh has a ``dp`` dim, averages
gradients over it. Per layer and training step this issues the Megatron
minimum: without SP 2 all_reduce forward + 2 backward; with SP 2 all_gather +
2 reduce_scatter in each direction (plus the all_reduce of the two replicated
norm weights' gradients).
"""
from __future__ import annotations

from hyper_parallel import (ColwiseParallel, PrepareModuleInput, Replicate, RowwiseParallel, SequenceParallel,
                            Shard, parallelize_module, replicate)


def parallelize_llama(model, mesh, *, sequence_parallel: bool = True, loss_parallel: bool = False,
                      src_data_rank=0):
    """Apply TP (+SP) on ``mesh['tp']`` and DP on ``mesh['dp']`` (if present) to ``model`` in place."""
    names = mesh.mesh_dim_names or ()
    tp_mesh = mesh["tp"] if "tp" in names else mesh
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()

    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                      use_local_output=not loss_parallel),
            **({"norm": SequenceParallel()} if sp else {}),
        }, src_data_rank=src_data_rank)
        block_plan = {
            "attention": PrepareModuleInput(input_layouts=(seq, None, None),
                                            desired_input_layouts=(Replicate(), None, None), use_local_output=True),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sp:
            block_plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, block_plan, src_data_rank=src_data_rank)
    if "dp" in names and mesh["dp"].size() > 1:
        replicate(model, mesh["dp"])
    return model
