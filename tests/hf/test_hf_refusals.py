"""What ``Plan.apply`` cannot do right on a Hugging Face model, it refuses with an error naming the module and the
fix (never a wrong number): positions it cannot place under context parallelism, attention that does not go
through SDPA, pipelines of decoder families whose loop the stages do not reproduce; and ``dry_run`` reads HF
outputs."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from examples.hf.presets import batch, build_model, loss_fn
from examples.hf.training import make_plan
from hyper_parallel.auto.hf_adapt import check_context_parallel
from hyper_parallel.auto.hf_pipeline import check_pipeline_model


def _tiny(config_cls, **kw):
    from transformers import AutoModelForCausalLM
    cfg = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **kw)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=kw.pop("attn", "sdpa"))


def test_cp_refuses_eager_attention_and_learned_positions():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig
    model = _tiny(LlamaConfig)
    model.config._attn_implementation = "eager"
    with pytest.raises(NotImplementedError, match="attn_implementation='sdpa'"):
        check_context_parallel(model, ["model.embed_tokens"])
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    gpt2.config._attn_implementation = "sdpa"
    with pytest.raises(NotImplementedError, match="'transformer.wpe'.*absolute position embedding"):
        check_context_parallel(gpt2, ["transformer.wte"])


def test_pipeline_refuses_unknown_families_sliding_windows_and_tied_heads():
    from transformers import GemmaConfig, LlamaConfig, MistralConfig
    with pytest.raises(NotImplementedError, match="model_type 'gemma'"):
        check_pipeline_model(_tiny(GemmaConfig, head_dim=8), "model.layers")
    with pytest.raises(NotImplementedError, match="sliding_window=8"):
        check_pipeline_model(_tiny(MistralConfig, sliding_window=8), "model.layers")
    tied = _tiny(LlamaConfig)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    with pytest.raises(NotImplementedError, match="tie_word_embeddings=False"):
        check_pipeline_model(tied, "model.layers")
    assert check_pipeline_model(_tiny(LlamaConfig), "model.layers") == "model"


def _unsharded_forward_body():
    plan = make_plan("llama-tiny", 2, {"cp": 2}, global_batch=2, seq_len=16)
    model = plan.apply(build_model("llama-tiny"))
    x, y = batch(0, 0, 2, 16, 96)
    try:
        model(x)   # the whole sequence, not plan.shard_batch's cut: positions unknown
    except RuntimeError as e:
        msg = str(e)
    else:
        msg = None
    xs, ys = plan.shard_batch(x, y)
    loss = loss_fn(model(xs), ys)   # after shard_batch it runs
    return msg, bool(torch.isfinite(loss))


def test_cp_forward_without_sharded_batch_raises_naming_the_rotary_module(dist_runner):
    for msg, ok in dist_runner.run(2, _unsharded_forward_body):
        assert msg is not None and "'model.rotary_emb'" in msg and "plan.shard_batch" in msg, msg
        assert ok


class _EagerAttention(nn.Module):
    def forward(self, q, k, v):
        w = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        return torch.softmax(w, -1) @ v


class _SdpaAttention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _context_parallel_without_sdpa_body():
    import hyper_parallel as hp
    from hyper_parallel.context_parallel import ContextParallel, cp_shard
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (qs,) = cp_shard(mesh, [q], [2])
    ok = hp.parallelize_module(_SdpaAttention(), mesh, ContextParallel())(qs, qs, qs)
    eager = hp.parallelize_module(_EagerAttention(), mesh, ContextParallel())
    try:
        eager(qs, qs, qs)
    except RuntimeError as e:
        return str(e), tuple(ok.shape)
    return None, tuple(ok.shape)


def test_context_parallel_raises_when_its_module_runs_no_sdpa(dist_runner):
    for msg, shape in dist_runner.run(2, _context_parallel_without_sdpa_body):
        assert shape == (1, 2, 4, 4)
        assert msg is not None and "_EagerAttention" in msg and "no F.scaled_dot_product_attention" in msg, msg


@pytest.mark.parametrize("degrees, sp", [({"fsdp": 2, "tp": 2}, True), ({"fsdp": 2, "cp": 2}, False),
                                         ({"fsdp": 2, "pp": 2}, False)])
def test_dry_run_reads_hf_outputs(degrees, sp):
    from hyper_parallel.auto.dry_run import dry_run
    plan = make_plan("llama-tiny", 4, degrees, global_batch=8, seq_len=16, sequence_parallel=sp)
    result = dry_run(plan, lambda: build_model("llama-tiny"), world_size=4)
    assert result.peak_memory > 0


def _manual_cp_body(hook):
    """An HF Llama parallelized by hand (ContextParallel on every attention, cp_shard of the batch), with or without
    hook_position_ids on its rotary module: the loss of one forward, summed over the cp ranks."""
    import hyper_parallel as hp
    from hyper_parallel.context_parallel import ContextParallel, cp_shard, hook_position_ids
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = build_model("llama-tiny")
    hp.parallelize_module(model, mesh, {"model.layers.*.self_attn": ContextParallel(method="ring")})
    if hook:
        hook_position_ids(model.model.rotary_emb, mesh)
    x, y = batch(0, 0, 2, 16, 96)
    xs, ys = cp_shard(mesh, [x, y], [1, 1])
    loss = loss_fn(model(xs), ys).detach().reshape(1)
    dist.all_reduce(loss)
    return loss.item() / 2


def test_hook_position_ids_makes_hand_parallelized_hf_cp_exact(dist_runner):
    x, y = batch(0, 0, 2, 16, 96)
    ref = loss_fn(build_model("llama-tiny")(x), y).item()
    hooked = dist_runner.run(2, _manual_cp_body, True)[0]
    bare = dist_runner.run(2, _manual_cp_body, False)[0]
    assert abs(hooked - ref) <= 1e-12 * abs(ref), (hooked, ref)
    assert abs(bare - ref) > 1e-8 * abs(ref), (bare, ref)   # without the hook: rotary of positions 0..S/cp
