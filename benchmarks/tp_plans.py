"""The Llama-block TP(+SP) plan, written once for both libraries.

``lib`` is either the ``hyper_parallel`` module or :class:`TorchLib`: both expose the same style
names, so the benchmarks apply literally the same plan to torch's DTensor and ours.
"""


def llama_block_plan(lib, sp):
    """torchtitan's per-block plan: q/k/v and w1/w3 column-wise, wo/w2 row-wise; SP norms if ``sp``."""
    P = lib
    seq = P.Shard(1) if sp else P.Replicate()
    plan = {
        "attention.wq": P.ColwiseParallel(), "attention.wk": P.ColwiseParallel(), "attention.wv": P.ColwiseParallel(),
        "attention.wo": P.RowwiseParallel(output_layouts=seq),
        "feed_forward.w1": P.ColwiseParallel(), "feed_forward.w3": P.ColwiseParallel(),
        "feed_forward.w2": P.RowwiseParallel(output_layouts=seq),
    }
    if sp:
        plan.update({
            "attention_norm": P.SequenceParallel(), "ffn_norm": P.SequenceParallel(),
            "attention": P.PrepareModuleInput(input_layouts=(P.Shard(1), None, None),
                                              desired_input_layouts=(P.Replicate(), None, None),
                                              use_local_output=True),
            "feed_forward": P.PrepareModuleInput(input_layouts=(P.Shard(1),), desired_input_layouts=(P.Replicate(),),
                                                 use_local_output=True),
        })
    return plan


class TorchLib:
    """torch.distributed.tensor's names under the attribute names ``hyper_parallel`` uses."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: F401
    from torch.distributed.tensor.parallel import (  # noqa: F401
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module)
