"""Example Llama under TP / TP+SP / DP x TP: every step's loss and the final parameters equal
single-process training; each layer issues the Megatron minimum of collectives."""
import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from examples.llama.configs import OptimConfig
from examples.llama.data import TokenBatches, dp_shard
from examples.llama.model import ModelArgs, build_model, loss_fn
from examples.llama.parallelize import parallelize_llama
from examples.llama.reference import build_optimizer, train_reference

# 4 kv heads so that tp=4 shards whole heads; seq 32 divisible by tp for SP
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=260, multiple_of=32, max_seq_len=32)
GQA = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=260, multiple_of=32, max_seq_len=32,
                tie_embeddings=True)
STEPS, BATCH, SEQ = 10, 8, 32


def _train(dp, tp, sp, args):
    torch.manual_seed(1234)
    mesh = hp.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = build_model(args, 0)
    parallelize_llama(model, mesh, sequence_parallel=sp)
    opt = build_optimizer(model.parameters(), OptimConfig())
    data = TokenBatches(seed=0)
    losses = []
    for step in range(STEPS):
        x, y = data.get_batch(step, BATCH, SEQ)
        r = mesh.get_local_rank(0)
        x, y = dp_shard(x, r, dp), dp_shard(y, r, dp)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OptimConfig().max_grad_norm)
        opt.step()
        g = loss.detach().clone()
        dist.all_reduce(g, group=mesh.get_group(0))
        losses.append(g.item() / dp)
    ref_losses, ref_state = train_reference(args, STEPS, seed=0, global_batch=BATCH, seq_len=SEQ)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs single-process {b}"
    for name, p in model.state_dict().items():
        full = p.full_tensor() if isinstance(p, hp.DTensor) else p
        torch.testing.assert_close(full, ref_state[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("dp,tp,sp,args", [
    (1, 2, False, ARGS), (1, 4, False, ARGS), (1, 2, True, ARGS), (2, 2, True, ARGS), (2, 2, False, GQA)],
    ids=["tp2", "tp4", "tp2_sp", "dp2_tp2_sp", "dp2_tp2_gqa_tied"])
def test_llama_training_parity(dist_runner, dp, tp, sp, args):
    dist_runner.run(dp * tp, _train, dp, tp, sp, args)


def _layer_counts(sp):
    mesh = hp.init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = build_model(ARGS, 0)
    parallelize_llama(model, mesh, sequence_parallel=sp)
    block = model.layers["0"]
    x = torch.randn(2, SEQ // (2 if sp else 1), ARGS.dim, requires_grad=True)
    cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]
    with hp.CommDebugMode() as fwd:
        out = block(x, cos, sin)
    with hp.CommDebugMode() as bwd:
        out.sum().backward()
    return fwd.get_comm_counts(), bwd.get_comm_counts()


def test_layer_collective_counts(dist_runner):
    fwd, bwd = dist_runner.run(2, _layer_counts, False)[0]
    assert fwd == {"all_reduce": 2}, fwd
    assert bwd == {"all_reduce": 2}, bwd
    fwd, bwd = dist_runner.run(2, _layer_counts, True)[0]
    assert fwd == {"all_gather": 2, "reduce_scatter": 2}, fwd
    # the two replicated RMSNorm weights' gradients are summed over the sequence shards
    assert bwd == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 2}, bwd
