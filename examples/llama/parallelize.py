"""Tensor/sequence/data parallel plan for the example Llama (torchtitan style, one screen).

``parallelize_llama(model, mesh, sequence_parallel=True)`` shards every block
Megatron-style over ``mesh["tp"]`` and, when the mesh has a ``dp`` dim, averages
gradients over it. Per layer and training step this issues the Megatron
minimum: without SP 2 all_reduce forward + 2 backward; with SP 2 all_gather +
2 reduce_scatter in each direction (plus the all_reduce of the two replicated
norm weights' gradients).

``loss_parallel=True`` keeps the logits vocabulary-sharded (a DTensor
``Shard(-1)`` on ``mesh["tp"]``) instead of gathering them; compute the loss
inside ``with hyper_parallel.loss_parallel():`` (``train_loss`` below does), which
takes the plain token targets as they are (replicated over tp) and never
gathers the vocabulary.
"""
from __future__ import annotations

import contextlib

import hyper_parallel as hp
from hyper_parallel import (ColwiseParallel, PrepareModuleInput, Replicate, RowwiseParallel, SequenceParallel,
                            Shard, parallelize_module, replicate)
from examples.llama.model import RMSNorm

# The example's hand-written RMSNorm normalises each token on its own, so it may run on
# sequence-sharded activations: let SequenceParallel accept it (nn.RMSNorm is built in).
SequenceParallel.register_module_type(RMSNorm)


def parallelize_llama(model, mesh, *, sequence_parallel: bool = True, loss_parallel: bool = False,
                      src_data_rank=0, cp_method: str = "ring"):
    """Apply TP (+SP) on ``mesh['tp']`` and DP on ``mesh['dp']`` (if present) to ``model`` in place.

    A ``dp_shard`` mesh dim makes the data parallelism fully sharded: every block and
    then the root are ``fully_shard``-ed on ``mesh['dp_shard']`` (on
    ``mesh['dp', 'dp_shard']``, i.e. HSDP, when ``dp`` is present too).
    """
    names = mesh.mesh_dim_names or ()
    tp_mesh = mesh["tp"] if "tp" in names else mesh
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()

    if tp_mesh.size() > 1 and ("tp" in names or not {"dp", "dp_shard"} & set(names)):
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
    # --- CP: context parallelism on the cp dim(s); the data-parallel meshes below then cover cp
    from examples.llama.context_parallel import apply_context_parallel, cp_dims, dp_mesh_with_cp
    apply_context_parallel(model, mesh, cp_method)
    if cp_dims(mesh) and "dp_shard" in names and "dp" in names and mesh["dp"].size() > 1:
        raise ValueError("context parallelism with HSDP (--dp > 1 with --dp-shard) is not supported; "
                         "use --dp-shard (FSDP over dp_shard x cp) or --dp (replicate over dp x cp)")
    # --- end CP
    if "dp_shard" in names:
        # FSDP (HSDP when a "dp" replicate dim is present): one fully_shard group per block plus the root
        fsdp_mesh = mesh["dp", "dp_shard"] if "dp" in names else mesh["dp_shard"]
        if cp_dims(mesh):  # --- CP: parameters sharded over the flattened (dp_shard, cp) dims
            fsdp_mesh = dp_mesh_with_cp(mesh, "dp_shard")
        for block in model.layers.values():
            hp.fully_shard(block, mesh=fsdp_mesh)
        hp.fully_shard(model, mesh=fsdp_mesh)
    elif "dp" in names and (mesh["dp"].size() > 1 or cp_dims(mesh)):  # --- CP: or gradients summed over cp
        replicate(model, dp_mesh_with_cp(mesh, "dp"))
    return model


def train_loss(model, tokens, targets, loss_fn, *, loss_parallel: bool = False):
    """Forward + loss + backward of one step; returns the loss as a plain tensor (this rank's batch mean).

    With ``loss_parallel`` the cross-entropy runs on the vocabulary-sharded logits
    inside ``hyper_parallel.loss_parallel()`` (three all_reduces of [tokens] values,
    no communication backward).
    """
    with hp.loss_parallel() if loss_parallel else contextlib.nullcontext():
        loss = loss_fn(model(tokens), targets)
        loss.backward()
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, hp.DTensor) else loss
