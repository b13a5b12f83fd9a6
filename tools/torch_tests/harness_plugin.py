"""pytest plugin (-p harness_plugin): deselect EXCLUDED tests by exact node id (pytest's own
--deselect matches by prefix, which also dropped e.g. test_to_local_grad_hint with test_to_local).
Set ALL=1 to keep them."""
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import excluded  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ALL") == "1":
        return
    keep, drop = [], []
    for it in items:
        (drop if excluded.reason(it.nodeid) else keep).append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
