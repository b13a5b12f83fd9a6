"""Run HyperParallel's per-op torch test scripts (``tests/torch/shard/ops/parallel_op_*.py``) on hyper_parallel.

Measurement tool for issue 33 (not part of the suite: HyperParallel's files are not in this
repository). It reads the scripts from a clone of mindspore-ai/hyper-parallel (a bare git dir, e.g.
the one the session's ``fetch`` tool gives, or any checkout), writes them into a temporary package
with the NPU spelled as CPU (``.npu()`` dropped, ``"npu"`` -> ``"cpu"``, no ``torch_npu``) and
HyperParallel's two test helpers (``tests.torch.utils.init_dist``: the harness's process group;
``tests.torch.shard.utils``: its own file, unchanged), then runs every ``test_*`` function on 8
gloo ranks (``tests/harness.py``), with strict layouts on (``strict``) or off (``off``).

    .venv/bin/python tools/hp_tests/run_op_scripts.py /path/to/hyper-parallel.git strict [cumsum softmax ...]

One line per test function (``pass`` or the first rank's error), then the totals.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OPS = ["cumsum", "expand", "isin", "layernorm", "masked_scatter", "multinomial", "pad",
               "repeat_interleave", "scaled_dot_product_attention", "scatter", "softmax", "sort", "split",
               "squeeze", "topk", "unbind"]

_DRIVER = '''
import importlib, warnings
def run_test(modname, fname, strict):
    import hyper_parallel as hp
    fn = getattr(importlib.import_module(modname), fname)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with hp.strict_layouts(strict):
                fn()
        return "pass"
    except BaseException as e:  # noqa: B036 - reported, not swallowed
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return f"FAIL {type(e).__name__}: {first}"
'''


def _show(repo, path):
    git = ["git", "--git-dir", repo] if os.path.isdir(os.path.join(repo, "objects")) else ["git", "-C", repo]
    return subprocess.run(git + ["show", f"HEAD:{path}"], check=True, capture_output=True, text=True).stdout


def build(repo, ops, dest):
    pkg = os.path.join(dest, "hptests")
    for sub in ("", "torch", "torch/shard", "torch/shard/ops"):
        os.makedirs(os.path.join(pkg, sub), exist_ok=True)
        open(os.path.join(pkg, sub, "__init__.py"), "w").close()
    with open(os.path.join(pkg, "torch", "utils.py"), "w") as f:
        f.write("import torch.distributed as dist\n\n\ndef init_dist():\n"
                "    return dist.get_rank(), dist.get_world_size()\n")
    with open(os.path.join(pkg, "torch", "shard", "utils.py"), "w") as f:
        f.write(_show(repo, "tests/torch/shard/utils.py"))
    with open(os.path.join(pkg, "driver.py"), "w") as f:
        f.write(_DRIVER)
    names = {}
    for op in ops:
        src = _show(repo, f"tests/torch/shard/ops/parallel_op_{op}.py")
        src = src.replace(".npu()", "").replace('"npu"', '"cpu"').replace("'npu'", "'cpu'")
        src = re.sub(r"^import torch_npu.*$", "", src, flags=re.M).replace("from tests.torch", "from hptests.torch")
        with open(os.path.join(pkg, "torch", "shard", "ops", f"parallel_op_{op}.py"), "w") as f:
            f.write(src)
        names[op] = re.findall(r"^def (test_\w+)\(", src, flags=re.M)
    return names


def main(argv):
    if len(argv) < 2 or argv[1] not in ("strict", "off"):
        raise SystemExit(__doc__)
    repo, strict, ops = argv[0], argv[1] == "strict", argv[2:] or DEFAULT_OPS
    dest = tempfile.mkdtemp(prefix="hp_op_scripts_")
    names = build(repo, ops, dest)
    sys.path[:0] = [dest, ROOT]
    os.environ["PYTHONPATH"] = os.pathsep.join([dest, ROOT, os.environ.get("PYTHONPATH", "")])
    from tests.harness import run_distributed
    from hptests.driver import run_test
    total = failing = 0
    for op in ops:
        for fname in names[op]:
            try:
                res = run_distributed(8, run_test, f"hptests.torch.shard.ops.parallel_op_{op}", fname, strict,
                                      timeout=180)
                status = next((r for r in res if r != "pass"), "pass")
            except Exception as e:  # a hung or dead job: reported, the next test gets a fresh pool
                status = f"HARNESS {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            total += 1
            failing += status != "pass"
            print(f"{argv[1]} parallel_op_{op}::{fname}: {status}", flush=True)
    print(f"TOTAL {total} pass {total - failing} failing {failing}")


if __name__ == "__main__":
    main(sys.argv[1:])
