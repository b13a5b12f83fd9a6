"""Importing the core loads the core only (issue 39): ``import hyper_parallel.dtensor`` (which runs the package
root) must not load the parallelism packages or the planner, and the root's lazy names still resolve.

Each check runs in a fresh interpreter: the test process has long imported everything.
"""
import subprocess
import sys

import pytest

HEAVY = ("fsdp", "pipelining", "moe", "context_parallel", "auto", "tensor_parallel", "core", "swap")


def _loaded_after(statement: str):
    code = (f"import sys\n{statement}\n"
            "print(' '.join(sorted({m.split('.')[1] for m in sys.modules if m.startswith('hyper_parallel.')})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


@pytest.mark.parametrize("statement", ["import hyper_parallel.dtensor", "import hyper_parallel",
                                       "from hyper_parallel import DTensor, Shard, distribute_tensor"])
def test_core_import_loads_no_parallelism_package(statement):
    loaded = _loaded_after(statement)
    assert "dtensor" in loaded and "dispatch" in loaded
    assert not loaded & set(HEAVY), f"{statement!r} loaded {sorted(loaded & set(HEAVY))}"


def test_lazy_root_names_resolve_to_their_homes():
    import hyper_parallel as hp
    from hyper_parallel.fsdp import fully_shard
    from hyper_parallel.fsdp.hsdp import hsdp
    from hyper_parallel.tensor_parallel import ColwiseParallel, parallelize_module
    assert hp.fully_shard is fully_shard and hp.hsdp is hsdp
    assert hp.ColwiseParallel is ColwiseParallel and hp.parallelize_module is parallelize_module
    assert hp.core.dtensor.DTensor is hp.DTensor
    for name in hp.__all__:
        assert getattr(hp, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        hp.not_a_name  # noqa: B018
    assert not hasattr(hp, "_testing_reset")
