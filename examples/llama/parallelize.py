"""Tensor/sequence/data parallel plan for the example Llama (torchtitan style, one screen).

``parallelize_llama(model, mesh, sequence_parallel=True)`` shards every block
Megatron-style over ``mesh["tp"]`` and, when the mesh has a ``dp`` dim, averages
gradients over it. Per layer and training step this issues the Megatron
minimum: without SP 2 all_reduce forward + 2 backward; with SP 2 all_gather +
2 reduce_scatter in each direction (plus the all_reduce of the two replicated
norm weights' gradients).

Expert parallelism (MoE configs, mesh dims ``("efsdp", "ep", "tp")``, see ``make_moe_mesh``): the
``ep`` dim is borrowed from the fully sharded data parallelism (torchtitan's layout): ``dp_shard =
efsdp x ep``. Experts are sharded ``Shard(0)`` over ``ep`` (``hyper_parallel.moe.ExpertParallel``)
and ``fully_shard``-ed over the remaining ``efsdp`` ranks; everything else is ``fully_shard``-ed
over all ``efsdp x ep`` data-parallel ranks. With ``tp`` the router stays replicated, the shared
expert is Megatron TP like the dense FFN, and the routed experts are replicated over tp (every tp
rank of a data-parallel rank runs the same tokens through them), or, with
``expert_tensor_parallel=True``, ``ExpertTensorParallel`` on ``("ep", "tp")`` (w1/w3 column-, w2
row-parallel inside each expert; one all_reduce of the routed rows over tp forward and one backward).

``loss_parallel=True`` keeps the logits vocabulary-sharded (a DTensor
``Shard(-1)`` on ``mesh["tp"]``) instead of gathering them; compute the loss
inside ``with hyper_parallel.loss_parallel():`` (``train_loss`` below does), which
takes the plain token targets as they are (replicated over tp) and never
gathers the vocabulary.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
                            Replicate, RowwiseParallel, SequenceParallel, Shard, parallelize_module, replicate)
from hyper_parallel.moe import ExpertParallel, ExpertTensorParallel
from examples.llama.model import RMSNorm
from examples.llama.moe import MoE

# The example's hand-written RMSNorm normalises each token on its own, so it may run on
# sequence-sharded activations: let SequenceParallel accept it (nn.RMSNorm is built in).
SequenceParallel.register_module_type(RMSNorm)


def parallelize_llama(model, mesh, *, sequence_parallel: bool = True, loss_parallel: bool = False,
                      src_data_rank=0, expert_tensor_parallel: bool = False, cp_method: str = "ring"):
    """Apply TP (+SP) on ``mesh['tp']`` and DP on ``mesh['dp']`` (if present) to ``model`` in place.

    A ``dp_shard`` mesh dim makes the data parallelism fully sharded: every block and
    then the root are ``fully_shard``-ed on ``mesh['dp_shard']`` (on
    ``mesh['dp', 'dp_shard']``, i.e. HSDP, when ``dp`` is present too).
    """
    names = mesh.mesh_dim_names or ()
    if "ep" in names:
        return _parallelize_moe(model, mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                                src_data_rank=src_data_rank, etp=expert_tensor_parallel)
    tp_mesh = mesh["tp"] if "tp" in names else mesh
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()

    if tp_mesh.size() > 1 and ("tp" in names or not {"dp", "dp_shard"} & set(names)):
        ends = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                      use_local_output=not loss_parallel),
            **({"norm": SequenceParallel()} if sp else {}),
        }
        ends = {k: v for k, v in ends.items() if getattr(model, k, None) is not None}  # pipeline stages lack some
        if ends:
            parallelize_module(model, tp_mesh, ends, src_data_rank=src_data_rank)
        block_plan = {
            **_attention_plan(seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sp:
            block_plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, _moe_tp_plan(seq) if hasattr(block, "moe") else block_plan,
                               src_data_rank=src_data_rank)
        # --- pipeline stages (--pp, examples/llama/pipeline.py): with SP the hidden state crossing a stage
        # boundary is a DTensor Shard(1) on mesh["tp"] (sent as its local shard, rebuilt by the next stage)
        keys = list(model.layers.keys())
        if sp and keys and getattr(model, "tok_embeddings", 0) is None:
            parallelize_module(model.layers[keys[0]], tp_mesh, PrepareModuleInput(
                input_layouts=(seq, None, None), desired_input_layouts=(seq, None, None), use_local_output=True))
        if sp and keys and getattr(model, "output", 0) is None:
            parallelize_module(model.layers[keys[-1]], tp_mesh, PrepareModuleOutput(
                output_layouts=seq, desired_output_layouts=seq, use_local_output=False))
    # --- CP: context parallelism on the cp dim(s); the data-parallel meshes below then cover cp
    from examples.llama.context_parallel import apply_context_parallel, cp_dims, dp_mesh_with_cp
    apply_context_parallel(model, mesh, cp_method)
    if cp_dims(mesh) and "dp_shard" in names and "dp" in names and mesh["dp"].size() > 1:
        raise ValueError("context parallelism with HSDP (--dp > 1 with --dp-shard) is not supported; "
                         "use --dp-shard (FSDP over dp_shard x cp) or --dp (replicate over dp x cp)")
    # --- end CP
    # --- CP x PP: a pipeline stage's mesh ("pp", "dp_shard", "cp", "tp") has no "dp" dim: FSDP over the flattened
    # (dp_shard, cp) dims reduces the gradients over cp even when dp_shard is 1
    cp_pp = "pp" in names and "dp" not in names and bool(cp_dims(mesh))
    if "dp_shard" in names and (mesh["dp_shard"].size() > 1 or cp_pp):
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


# ----------------------------------------------------------------------------- mixture of experts (--ep)


def _attention_plan(seq):
    """Megatron TP of a block's attention (dense and MoE blocks alike): heads sharded by q/k/v colwise,
    ``wo`` rowwise back to ``seq`` (``Shard(1)`` with sequence parallelism, else ``Replicate()``)."""
    return {
        "attention": PrepareModuleInput(input_layouts=(seq, None, None),
                                        desired_input_layouts=(Replicate(), None, None), use_local_output=True),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
    }


def _moe_tp_plan(seq):
    """TP of an MoE block: attention as in the dense plan; the MoE takes and returns ``seq`` tensors,
    its router is replicated, its shared expert colwise/rowwise, its routed experts replicated."""
    plan = {
        **_attention_plan(seq),
        "moe.shared_experts.w1": ColwiseParallel(),
        "moe.shared_experts.w2": RowwiseParallel(output_layouts=Replicate()),
        "moe.shared_experts.w3": ColwiseParallel(),
    }
    if isinstance(seq, Shard):  # sequence parallel: gather the sequence in, slice it out again
        plan.update({
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "moe": PrepareModuleInputOutput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                            use_local_input=True, output_layouts=(Replicate(),),
                                            desired_output_layouts=(seq,), use_local_output=True)})
    return plan


def make_moe_mesh(device_type, dp_shard: int, ep: int, tp: int = 1, pp: int = 1):
    """The ``("efsdp", "ep", "tp")`` mesh: ``ep`` borrows ranks from ``dp_shard`` (``efsdp = dp_shard/ep``).

    The data-parallel dim over all ``dp_shard`` ranks is the flattening of ``efsdp x ep``
    (``mesh["dp_shard"]``, registered here; dense layers are fully sharded over it).
    ``pp > 1`` (``train.py --pp --ep``, examples/llama/pipeline.py): ``("pp", "efsdp", "ep", "tp")``,
    each pipeline stage's ranks are one ``efsdp x ep x tp`` slice.
    """
    if ep < 1 or dp_shard % ep:
        raise ValueError(f"--ep {ep} must divide --dp-shard {dp_shard}: expert parallelism borrows its ranks from "
                         "the fully sharded data parallelism")
    if pp > 1:  # --- pipeline x EP
        mesh = hp.init_device_mesh(device_type, (pp, dp_shard // ep, ep, tp),
                                   mesh_dim_names=("pp", "efsdp", "ep", "tp"))
    else:
        mesh = hp.init_device_mesh(device_type, (dp_shard // ep, ep, tp), mesh_dim_names=("efsdp", "ep", "tp"))
    mesh["efsdp", "ep"]._flatten("dp_shard")
    return mesh


_DENSE_PP_MESH = {}  # --- pipeline x EP: id(the ("pp", "efsdp", "ep", "tp") mesh) -> its ("pp", "dp_shard", "tp") twin


def _dense_mesh(mesh, dp_shard, tp):
    """The ``("dp_shard", "tp")`` root mesh of the dense parts over the same ranks (with ``pp``: the
    ``("pp", "dp_shard", "tp")`` one, built once per EP mesh, since a rank parallelizes one stage or more)."""
    if "pp" not in mesh.mesh_dim_names:
        return hp.init_device_mesh(mesh.device_type, (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))
    key = id(mesh)
    if key not in _DENSE_PP_MESH:
        _DENSE_PP_MESH[key] = (mesh, hp.init_device_mesh(mesh.device_type, (mesh.size("pp"), dp_shard, tp),
                                                         mesh_dim_names=("pp", "dp_shard", "tp")))
    return _DENSE_PP_MESH[key][1]


def dp_group_of(mesh):
    """The process group of all data-parallel ranks (None when there is one), for the expert-bias all_reduce."""
    names = mesh.mesh_dim_names or ()
    if "ep" in names:
        dp_mesh = mesh["dp_shard"]
    elif "dp_shard" in names:
        dp_mesh = mesh["dp", "dp_shard"]._flatten("dp_all") if "dp" in names else mesh["dp_shard"]
    elif "dp" in names:
        dp_mesh = mesh["dp"]
    else:
        return None
    return dp_mesh.get_group() if dp_mesh.size() > 1 else None


def clip_grad_norm_(parameters, max_norm: float):
    """``torch.nn.utils.clip_grad_norm_`` for parameters on several meshes (EP: experts live on the
    ``(efsdp, ep, tp)`` mesh, the rest on the flattened ``dp_shard`` one): one norm per mesh, combined.
    Returns the total norm (a plain tensor)."""
    import torch  # noqa: PLC0415
    params = [p for p in parameters if p.grad is not None]
    groups = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, hp.DTensor) else None
        groups.setdefault(key, []).append(p)
    sq = None
    for key, ps in groups.items():
        n = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0)
        if isinstance(n, hp.DTensor):
            n = n.full_tensor()
        sq = n * n if sq is None else sq + n * n
    if sq is None:
        return torch.zeros(())
    total = sq.sqrt()
    for ps in groups.values():  # one foreach per mesh
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, gradient all_reduce over tp backward (the experts' rows under
    expert-tensor parallelism: each tp rank's column-parallel w1/w3 give a partial input gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all_reduce over tp forward (the row-parallel w2's partial sums), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _expert_tensor_parallel(experts, ep_tp_mesh, src_data_rank):
    """``ExpertTensorParallel`` on the ``("ep", "tp")`` mesh, plus the tp reductions the style leaves to the
    caller: the rows it hands the local experts get ``f``, the combined (partial over tp) output ``g``, so
    everything outside the experts stays replicated over tp (router gradients included)."""
    parallelize_module(experts, ep_tp_mesh, ExpertTensorParallel(), src_data_rank=src_data_rank)
    group = ep_tp_mesh["tp"].get_group()
    # registered after the style's own hooks: they run after its dispatch / after its combine
    experts.register_forward_pre_hook(lambda mod, args: (_CopyToTP.apply(args[0], group),) + tuple(args[1:]))
    experts.register_forward_hook(lambda mod, args, out: _ReduceFromTP.apply(out, group))


def _parallelize_moe(model, mesh, *, sequence_parallel, loss_parallel, src_data_rank, etp=False):
    """EP (+ efsdp) x FSDP x TP on a ``make_moe_mesh`` mesh; ``etp``: experts tensor parallel over tp
    (``ExpertTensorParallel``), else replicated over tp."""
    num_experts = [b.moe.experts.num_experts for b in model.layers.values() if hasattr(b, "moe")]
    ep = mesh.size("ep")
    for e in num_experts:
        if e % ep:
            raise ValueError(f"the MoE layers have {e} experts, which --ep {ep} does not divide")
    # Dense parts live on a ("dp_shard", "tp") root mesh over the same ranks (dp_shard index =
    # efsdp index * ep + ep index): fully_shard takes a TP parameter only with a mesh dim of the
    # TP mesh's root, and the experts' root is ("efsdp", "ep", "tp").
    dp_shard, tp = mesh.size("efsdp") * ep, mesh.size("tp")
    dense = _dense_mesh(mesh, dp_shard, tp)  # (with --pp: ("pp", "dp_shard", "tp"), this stage's slice used below)
    if tp > 1:  # TP of attention, dense FFN, output and shared experts; router and experts replicated over tp
        parallelize_llama(model, dense["tp"], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                          src_data_rank=src_data_rank)
    for block in model.layers.values():
        if hasattr(block, "moe") and etp and tp > 1:
            _expert_tensor_parallel(block.moe.experts, mesh["ep", "tp"], src_data_rank)
        elif hasattr(block, "moe"):
            parallelize_module(block.moe.experts, mesh["ep"], ExpertParallel(), src_data_rank=src_data_rank)
    for block in model.layers.values():
        if hasattr(block, "moe"):
            hp.fully_shard(block.moe.experts, mesh=mesh["efsdp"])
            # each ep rank's expert gradients sum over every data-parallel rank's tokens: average over all
            block.moe.experts.set_gradient_divide_factor(dp_shard)
        hp.fully_shard(block, mesh=dense["dp_shard"])
    hp.fully_shard(model, mesh=dense["dp_shard"])
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
