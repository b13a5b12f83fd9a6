"""fully_shard composed with TP/SP and loss_parallel (2-D), HSDP (2, 2) and HSDP x TP (2, 2, 2) on the
example Llama: every step's loss and the final parameters equal single-process training."""
import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from examples.llama.configs import OptimConfig
from examples.llama.data import TokenBatches, dp_shard
from examples.llama.model import ModelArgs, Transformer, build_model, loss_fn
from examples.llama.parallelize import parallelize_llama, train_loss
from examples.llama.reference import build_optimizer, train_reference

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=260, multiple_of=32, max_seq_len=32)
GQA_TIED = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=260, multiple_of=32, max_seq_len=32,
                     tie_embeddings=True)
MODELS = {"mha": ARGS, "gqa_tied": GQA_TIED}
STEPS, BATCH, SEQ = 4, 8, 32
# float64: in float32, AdamW turns round-off in near-zero gradients into parameter differences
# of up to lr per step (seen at 1.1e-5 on a (2, 2, 2) mesh), which would hide real bugs in noise
RTOL, ATOL = 1e-9, 1e-9
_REF = {}


def _reference(model_name):
    if model_name not in _REF:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            _REF[model_name] = train_reference(MODELS[model_name], STEPS, seed=0, global_batch=BATCH, seq_len=SEQ)
        finally:
            torch.set_num_threads(threads)
            torch.set_default_dtype(dtype)
    return _REF[model_name]


def _train(shape, names, sp, loss_parallel, ref, model_name="mha"):
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _train64(shape, names, sp, loss_parallel, ref, model_name)
    finally:
        torch.set_default_dtype(dtype)


def _train64(shape, names, sp, loss_parallel, ref, model_name):
    mesh = hp.init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build_model(MODELS[model_name], 0)
    parallelize_llama(model, mesh, sequence_parallel=sp, loss_parallel=loss_parallel)
    assert isinstance(model, hp.FSDPModule)
    for n, p in model.named_parameters():
        assert isinstance(p, hp.DTensor) and p.device_mesh == mesh, n
    opt = build_optimizer(model.parameters(), OptimConfig())
    data = TokenBatches(seed=0)
    dp_names = [n for n in names if n.startswith("dp")]
    dp = 1
    for n in dp_names:
        dp *= mesh.size(n)
    r = 0
    for n in dp_names:  # row-major data-parallel index
        r = r * mesh.size(n) + mesh.get_local_rank(n)
    losses = []
    for step in range(STEPS):
        x, y = data.get_batch(step, BATCH, SEQ)
        x, y = dp_shard(x, r, dp), dp_shard(y, r, dp)
        opt.zero_grad(set_to_none=True)
        with hp.CommDebugMode() as comm:
            loss = train_loss(model, x, y, loss_fn, loss_parallel=loss_parallel)
        # per group (2 blocks + root): one all_gather forward, one again backward for the blocks, one
        # reduce_scatter over dp_shard, plus (HSDP) one all_reduce over the replicate dim
        on = lambda kind, dim: sum(1 for e in comm.events if e[0] == kind and e[2] == mesh.get_comm_group(dim).ranks)
        assert on("all_gather", "dp_shard") == 3 + 2 and on("reduce_scatter", "dp_shard") == 3, comm.events
        if "dp" in names:
            assert on("all_reduce", "dp") == 3, comm.events
        torch.nn.utils.clip_grad_norm_(model.parameters(), OptimConfig().max_grad_norm)
        opt.step()
        losses.append(loss.item())
    g = torch.tensor(losses)
    dist.all_reduce(g)
    tp = mesh.size("tp") if "tp" in names else 1
    losses = (g / (dp * tp)).tolist()
    ref_losses, ref_state = ref
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-9 * abs(b), f"{shape} step {step}: loss {a} vs single-process {b}"
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p.full_tensor(), ref_state[name], rtol=RTOL, atol=ATOL, msg=f"{shape} {name}")
    return True


CASES = {
    "fsdp2_tied_embeddings": ((2,), ("dp_shard",), False, False, "gqa_tied"),
    "fsdp2_tp2_sp_loss_parallel": ((2, 2), ("dp_shard", "tp"), True, True),
    "hsdp2x2": ((2, 2), ("dp", "dp_shard"), False, False),
    "hsdp2x2_tp2_sp": ((2, 2, 2), ("dp", "dp_shard", "tp"), True, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_tp_llama_parity(dist_runner, case):
    shape, names, sp, lp, *model = CASES[case]
    model_name = model[0] if model else "mha"
    n = 1
    for s in shape:
        n *= s
    assert dist_runner.run(n, _train, shape, names, sp, lp, _reference(model_name), model_name) == [True] * n


def _meta_llama():
    """Meta-device Llama -> TP + fully_shard -> to_empty -> the model's init: equal to one process's init."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    with torch.device("meta"):
        model = Transformer(ARGS, init_seed=None)
    parallelize_llama(model, mesh, sequence_parallel=True)
    assert all(p._local_tensor.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    with hp.implicit_replication():  # init_weights copies full CPU draws into the (sharded) parameters
        model.init_weights(0)
    ref = build_model(ARGS, 0).state_dict()
    n_local = 0
    for n, p in model.state_dict().items():
        assert p._local_tensor.device.type == "cpu", n
        torch.testing.assert_close(p.full_tensor(), ref[n], rtol=0, atol=0, msg=n)
        n_local += p._local_tensor.numel()
    return n_local, sum(t.numel() for t in ref.values())


def test_meta_init_fsdp_tp_llama(dist_runner):
    for n_local, total in dist_runner.run(4, _meta_llama):
        assert n_local < total / 3, (n_local, total)  # a quarter, plus the tp-replicated norm weights
