"""A plain transformers tensor-parallel program (no hyper_parallel import): run by torchrun as it is, or under
``python -m hyper_parallel.swap --only transformers``, by tests/hf/test_hf_tp_plan_swap.py.

``from_pretrained(path, tp_plan="auto")`` for each model directory given, one forward; rank 0 saves the
logits and, per model, the class and placements of two TP parameters (so the test sees which DTensor ran).
"""
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM


def main(out, paths):
    result = {}
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4, 8, 6]])
    for path in paths:
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        params = dict(model.named_parameters())
        probe = {}
        for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"):
            if key in params:
                p = params[key]
                probe[key] = (type(p).__module__, [str(pl) for pl in p.placements],
                              [type(pl).__module__ for pl in p.placements])
        result[path] = {"logits": logits.detach().clone(), "probe": probe}
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
