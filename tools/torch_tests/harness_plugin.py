"""pytest plugin (-p harness_plugin): deselect EXCLUDED tests by exact node id (pytest's own
--deselect matches by prefix, which also dropped e.g. test_to_local_grad_hint with test_to_local).
Set ALL=1 to keep them."""
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import excluded  # noqa: E402


def _variant_relative_id(item, variant_dir):
    """The node id with its file relative to the variant directory (run.sh's working directory).

    pytest names a node relative to its rootdir, which is the repository root (pyproject.toml has a
    [tool.pytest.ini_options] table), e.g. 'tools/torch_tests/hp/test_dtensor.py::C::t'; excluded.py's
    rules name files relative to the variant ('test_dtensor.py', 'parallel/test_tp_style.py').
    """
    try:
        rel = pathlib.Path(item.path).resolve().relative_to(variant_dir.resolve()).as_posix()
    except ValueError:
        return item.nodeid
    return rel + "::" + item.nodeid.split("::", 1)[1]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ALL") == "1":
        return
    keep, drop = [], []
    here = pathlib.Path(config.invocation_params.dir)
    for it in items:
        (drop if excluded.reason(_variant_relative_id(it, here)) else keep).append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
