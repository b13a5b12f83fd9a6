"""transformers' own tensor parallelism (``from_pretrained(path, tp_plan="auto")``) under
``python -m hyper_parallel.swap --only transformers`` on 2 gloo ranks (torchrun), against plain torch.

Tiny random ``LlamaForCausalLM`` and ``Qwen3MoeForCausalLM`` (whose fused experts ``gate_up_proj`` is
``_StridedShard(dim=1, split_factor=2)`` on the TP mesh) are saved with ``save_pretrained`` to a temporary
directory (no hub). The same unchanged program (tests/hf/tp_plan_program.py) runs once on torch and once
swapped; the logits agree within 1e-6, and with one process within 1e-5. The swapped run really uses
hyper_parallel's DTensor and placements (and runs under ``--strict``). Under ``--strict`` an unsupported
torch name reaches the user through transformers' own lazy importer (``_LazyModule``, which turns
RuntimeError/ModuleNotFoundError into "Could not import module 'X'").
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.harness.launch import run_launch

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = os.path.join(ROOT, "tests", "hf", "tp_plan_program.py")


def _save_models(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                             max_position_embeddings=64, head_dim=8))
    paths = []
    for name, model in (("llama", llama), ("qwen3_moe", moe)):
        path = str(tmp_path / name)
        model.save_pretrained(path)
        paths.append(path)
    return paths


def _torchrun(out, paths, swap: bool):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TRANSFORMERS_VERBOSITY="error")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    if swap:
        # --strict: the tensor-parallel path imports no torch name hyper_parallel lacks
        cmd += ["-m", "hyper_parallel.swap", "--strict", "--only", "transformers"]
    cmd += [PROGRAM, str(out), *paths]
    r = run_launch(cmd, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, " ".join(cmd) + "\n" + (r.stdout + r.stderr)[-6000:]
    return torch.load(out, weights_only=False)


def test_tp_plan_auto_under_swap_equals_torch(tmp_path):
    from transformers import AutoModelForCausalLM
    paths = _save_models(tmp_path)
    theirs = _torchrun(tmp_path / "torch.pt", paths, swap=False)
    ours = _torchrun(tmp_path / "ours.pt", paths, swap=True)
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4, 8, 6]])
    for path in paths:
        a, b = theirs[path]["logits"], ours[path]["logits"]
        assert a.shape == b.shape == (1, 10, 64)
        diff = (a - b).abs().max().item()
        assert diff <= 1e-6, f"{path}: swapped tp_plan='auto' logits differ from torch's by {diff}"
        with torch.no_grad():
            one = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids=ids).logits
        torch.testing.assert_close(b, one, rtol=1e-5, atol=1e-5)
        # the swapped run's parameters are hyper_parallel DTensors with hyper_parallel placements
        for key, (cls_mod, placements, pl_mods) in ours[path]["probe"].items():
            assert cls_mod.startswith("hyper_parallel"), (key, cls_mod)
            assert all(m.startswith("hyper_parallel") for m in pl_mods), (key, pl_mods)
            assert placements == theirs[path]["probe"][key][1], (key, placements)
    moe_probe = ours[paths[1]]["probe"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert moe_probe[1] == ["_S(1, 2)"], moe_probe


_STRICT = r'''
import os, sys
root = sys.argv[1]
os.makedirs(os.path.join(root, "lazypkg"))
with open(os.path.join(root, "lazypkg", "__init__.py"), "w") as f:   # transformers' lazy-module pattern
    f.write("import sys\nfrom transformers.utils.import_utils import _LazyModule\n"
            "sys.modules[__name__] = _LazyModule(__name__, __file__, {'configuration': ['LlamaLikeConfig']}, "
            "module_spec=__spec__)\n")
with open(os.path.join(root, "lazypkg", "configuration.py"), "w") as f:
    f.write("from torch.distributed.fsdp import FullyShardedDataParallel\nclass LlamaLikeConfig: pass\n")
sys.path.insert(0, root)
import hyper_parallel.swap as swap
swap.install(["lazypkg"], strict=True)
import lazypkg
try:
    lazypkg.LlamaLikeConfig
except swap.UnsupportedImportError as e:
    print("raised:", e)
'''


def test_strict_names_the_torch_name_through_the_lazy_importer(tmp_path):
    r = subprocess.run([sys.executable, "-c", _STRICT, str(tmp_path)], capture_output=True, text=True, timeout=180,
                       cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "raised: torch.distributed.fsdp.FullyShardedDataParallel is not supported by hyper_parallel" in r.stdout, \
        r.stdout + r.stderr
