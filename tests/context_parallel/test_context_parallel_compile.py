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
    from hyper_parallel.context_parallel import ContextParallel, cp_shard
    torch._dynamo.reset()
    from tests.context_parallel.test_context_parallel_api import check_cp_sums, llama_reference
    ref, model, tokens, labels, n_tok, loss_ref = llama_reference(S, 5)

    mesh = hp.init_device_mesh("cpu", (2,))
    hp.parallelize_module(model, mesh, {"layers.*.attention": ContextParallel(method=method)})
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=False))
    tok, lab, cos, sin = cp_shard(mesh, [tokens, labels, model.rope_cos[:S], model.rope_sin[:S]], [1, 1, 0, 0])
    model.rope_cos, model.rope_sin = cos, sin
    from hyper_parallel.context_parallel.sdpa_interception import CALLS
    counters.clear()
    CALLS.update(forward=0, backward=0)
    for _ in range(2):                                  # the second step reuses the compiled graphs
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tok).flatten(0, 1), lab.flatten(), reduction="sum") / n_tok
        loss.backward()
    check_cp_sums(loss, loss_ref, model, ref)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    assert CALLS == {"forward": 4, "backward": 4}, CALLS     # 2 blocks x 2 steps through the opaque op
    return True


@pytest.mark.parametrize("method,S", [("ring", 16), ("ulysses", 14)])
def test_compiled_blocks_context_parallel(dist_runner, method, S):
    dist_runner.run(2, _compiled_blocks, method, S)
