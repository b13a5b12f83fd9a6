"""``torch.compile`` of whole transformer blocks whose attention is made context-parallel by ``ContextParallel``.

Each block of the example Llama (attention with ``ContextParallel`` ring or Ulysses, cp 2) is compiled
with ``fullgraph=True`` (``aot_eager``): the intercepted SDPA becomes one opaque op
(``hyper_parallel_cp::sdpa``), so dynamo reports no graph break. Loss and every parameter's gradient
(summed over cp) equal one process in float64 (1e-10), as in eager.
"""
import pytest

TOL = 1e-10


def _compiled_blocks(method, S):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import hyper_parallel as hp
    from torch._dynamo.utils import counters
    from examples.llama.model import ModelArgs, build_model
    from hyper_parallel.context_parallel import ContextParallel, cp_shard
    torch._dynamo.reset()
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, max_seq_len=S)
    ref = build_model(args).double()
    model = build_model(args).double()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 50, (2, S), generator=g)
    labels = torch.randint(0, 50, (2, S), generator=g)
    n_tok = labels.numel()
    loss_ref = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten(), reduction="sum") / n_tok
    loss_ref.backward()

    mesh = hp.init_device_mesh("cpu", (2,))
    hp.parallelize_module(model, mesh, {"layers.*.attention": ContextParallel(method=method)})
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=False))
    tok, lab, cos, sin = cp_shard(mesh, [tokens, labels, model.rope_cos[:S], model.rope_sin[:S]], [1, 1, 0, 0])
    model.rope_cos, model.rope_sin = cos, sin
    from hyper_parallel.platform.torch.context_parallel.opaque import CALLS
    counters.clear()
    CALLS.update(forward=0, backward=0)
    for _ in range(2):                                  # the second step reuses the compiled graphs
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tok).flatten(0, 1), lab.flatten(), reduction="sum") / n_tok
        loss.backward()
    loss_all = loss.detach().clone()
    dist.all_reduce(loss_all)
    assert abs(float(loss_all) - float(loss_ref)) < TOL, (float(loss_all), float(loss_ref))
    errs = []
    for p, pr in zip(model.parameters(), ref.parameters()):
        gsum = p.grad.clone()
        dist.all_reduce(gsum)
        errs.append(float((gsum - pr.grad).abs().max()))
    assert max(errs) < TOL, errs
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    assert CALLS == {"forward": 4, "backward": 4}, CALLS     # 2 blocks x 2 steps through the opaque op
    return True


@pytest.mark.parametrize("method,S", [("ring", 16), ("ulysses", 14)])
def test_compiled_blocks_context_parallel(dist_runner, method, S):
    dist_runner.run(2, _compiled_blocks, method, S)
