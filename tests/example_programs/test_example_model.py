"""Single-process checks of the Llama example's plain-PyTorch parts (examples/llama)."""
import math

import pytest
import torch

from examples.llama.configs import get_config
from examples.llama.data import TokenBatches, dp_shard, load_corpus_tokens
from examples.llama.model import Attention, FeedForward, ModelArgs, Transformer, apply_rope, build_model, loss_fn
from examples.llama.plot import read_loss_csv, save_loss_curves
from examples.llama.reference import train_reference
from examples.llama.tokenizer import ByteTokenizer

TINY = get_config("tiny")


@pytest.fixture(scope="module")
def data():
    return TokenBatches(seed=0)


def test_forward_shape_and_initial_loss(data):
    model = build_model(TINY.model, seed=0)
    x, y = data.get_batch(0, 4, TINY.seq_len)
    logits = model(x)
    assert logits.shape == (4, TINY.seq_len, TINY.model.vocab_size)
    assert logits.dtype == torch.float32
    # Untrained: close to the uniform-distribution loss.
    assert abs(loss_fn(logits, y).item() - math.log(TINY.model.vocab_size)) < 1.0


def test_loss_decreases_and_is_deterministic():
    kw = dict(steps=20, seed=0, global_batch=TINY.global_batch, seq_len=TINY.seq_len, optim=TINY.optim)
    losses, sd = train_reference(TINY.model, **kw)
    losses2, sd2 = train_reference(TINY.model, **kw)
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    assert losses == losses2
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_init_is_a_function_of_seed():
    a, b, c = build_model(TINY.model, 0), build_model(TINY.model, 0), build_model(TINY.model, 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])


def test_torchtitan_names():
    names = set(build_model(TINY.model).state_dict())
    for n in ["tok_embeddings.weight", "norm.weight", "output.weight", "layers.1.attention_norm.weight",
              "layers.1.ffn_norm.weight", *(f"layers.0.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")),
              *(f"layers.0.feed_forward.{w}.weight" for w in ("w1", "w2", "w3"))]:
        assert n in names, n
    assert not any("rope" in n for n in names)  # rotary tables are non-persistent buffers


def test_tied_embeddings_share_the_parameter():
    args = ModelArgs(**{**TINY.model.__dict__, "tie_embeddings": True})
    model = build_model(args)
    assert model.output.weight is model.tok_embeddings.weight
    untied = build_model(TINY.model)
    assert untied.num_params() - model.num_params() == args.vocab_size * args.dim
    losses, sd = train_reference(args, steps=3, seed=0, global_batch=4, seq_len=16)
    assert torch.equal(sd["output.weight"], sd["tok_embeddings.weight"])


def _head_slice(full: Attention, args: ModelArgs, rank: int, tp: int) -> Attention:
    """What colwise wq/wk/wv + rowwise wo sharding leaves on one TP rank."""
    part = Attention(args)
    hd = args.head_dim
    q_rows = slice(rank * args.n_heads // tp * hd, (rank + 1) * args.n_heads // tp * hd)
    kv_rows = slice(rank * args.n_kv_heads // tp * hd, (rank + 1) * args.n_kv_heads // tp * hd)
    with torch.no_grad():
        part.wq.weight = torch.nn.Parameter(full.wq.weight[q_rows].clone())
        part.wk.weight = torch.nn.Parameter(full.wk.weight[kv_rows].clone())
        part.wv.weight = torch.nn.Parameter(full.wv.weight[kv_rows].clone())
        part.wo.weight = torch.nn.Parameter(full.wo.weight[:, q_rows].clone())
    return part


@pytest.mark.parametrize("tp", [2])
def test_attention_heads_from_shapes_allows_head_sharding(tp):
    """Sum over 'ranks' of head-sliced attention == full attention (the rowwise-wo all-reduce)."""
    args = TINY.model
    model = build_model(args)
    full = model.layers["0"].attention
    x = torch.randn(2, 12, args.dim, generator=torch.Generator().manual_seed(3))
    cos, sin = model.rope_cos[:12], model.rope_sin[:12]
    want = full(x, cos, sin)
    got = sum(_head_slice(full, args, r, tp)(x, cos, sin) for r in range(tp))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    ff = model.layers["0"].feed_forward
    h = args.ffn_hidden_dim // tp
    parts = []
    for r in range(tp):
        p = FeedForward(args)
        rows = slice(r * h, (r + 1) * h)
        p.w1.weight, p.w3.weight = (torch.nn.Parameter(ff.w1.weight[rows].clone()),
                                    torch.nn.Parameter(ff.w3.weight[rows].clone()))
        p.w2.weight = torch.nn.Parameter(ff.w2.weight[:, rows].clone())
        parts.append(p(x))
    torch.testing.assert_close(sum(parts), ff(x), rtol=1e-5, atol=1e-6)


def test_rope_is_real_and_relative():
    model = build_model(TINY.model)
    assert not model.rope_cos.is_complex() and not model.rope_sin.is_complex()
    g = torch.Generator().manual_seed(0)
    hd = TINY.model.head_dim
    q, k = torch.randn(1, 1, 1, hd, generator=g), torch.randn(1, 1, 1, hd, generator=g)
    cos, sin = model.rope_cos, model.rope_sin

    def score(i, j):  # <rope(q, i), rope(k, j)> depends only on i - j
        return (apply_rope(q, cos[i:i + 1], sin[i:i + 1]) * apply_rope(k, cos[j:j + 1], sin[j:j + 1])).sum()

    torch.testing.assert_close(score(5, 2), score(13, 10))
    torch.testing.assert_close(apply_rope(q, cos[:1], sin[:1]), q)  # position 0: identity


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 259 <= TINY.model.vocab_size
    text = "Fair is foul, and foul is fair — naïve café ✓\n"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids[1:-1]) < 256
    assert tok.decode(ids) == text
    assert tok.encode_tensor(text, bos=True, eos=True).tolist() == ids
    assert tok.encode_tensor("").numel() == 0


def test_batches_deterministic_shifted_and_dp_sharded(data):
    x, y = data.get_batch(7, 8, 16)
    x2, y2 = TokenBatches(seed=0).get_batch(7, 8, 16)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, data.get_batch(8, 8, 16)[0])
    assert not torch.equal(x, TokenBatches(seed=1).get_batch(7, 8, 16)[0])
    assert torch.equal(torch.cat([dp_shard(x, r, 4) for r in range(4)]), x)
    assert torch.equal(dp_shard(x, 1, 2), x[4:])
    with pytest.raises(ValueError):
        dp_shard(x, 0, 3)
    val = TokenBatches(seed=0, split="val")
    assert len(val) + len(data) == len(load_corpus_tokens())
    assert val.get_batch(0, 2, 16)[0].shape == (2, 16)


def test_corpus_is_the_documented_size():
    tokens = load_corpus_tokens()
    assert 150_000 < len(tokens) < 250_000
    assert int(tokens.max()) < 259


def test_loss_curve_files(tmp_path):
    series = {"reference": [3.0, 2.5, 2.25], "parallel": [3.0, 2.5]}
    paths = save_loss_curves(tmp_path / "loss", series)
    assert read_loss_csv(paths[0]) == series
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert paths[1].suffix == ".png" and paths[1].stat().st_size > 1000
