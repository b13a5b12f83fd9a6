"""The README's first program runs as printed (4 gloo ranks) and its result equals one process.

The code block is read from README.md, so the front page cannot drift from what the library does: the
collective counts it claims (``{'all_reduce': 2}``) and the value (the same matmul-and-sum on full
tensors, seeded alike on every rank) are checked.
"""
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _readme_program() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md has no python block"
    return blocks[0]


def _run(code):
    torch.manual_seed(0)  # every rank draws the same inputs (as distribute_tensor assumes)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own program
    return scope["comm"].get_comm_counts(), float(scope["total"])


def test_readme_first_program(dist_runner):
    code = _readme_program()
    assert "init_device_mesh" in code and "full_tensor" in code
    results = dist_runner.run(4, _run, code)
    torch.manual_seed(0)
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    want = float((x @ w).sum())
    for counts, total in results:
        assert dict(counts) == {"all_reduce": 2}
        assert abs(total - want) < 1e-4 * max(1.0, abs(want))
    assert "{'all_reduce': 2}" in code
