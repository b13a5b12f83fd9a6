"""Shared pytest fixtures: the multi-process distributed runner.

    def _body(x):                      # module level: pickled by reference
        import torch.distributed as dist
        return dist.get_rank() * x

    def test_something(dist_runner):   # `dist` is an alias of `dist_runner`
        assert dist_runner.run(4, _body, 10) == [0, 10, 20, 30]

``run(world_size, fn, *args, timeout=120, **kwargs)`` skips the test when
``world_size`` exceeds HP_TEST_MAX_WORLD_SIZE (default 8).
"""

from __future__ import annotations

import pytest

from tests.harness import (
    DistributedTestError,
    DistributedTimeoutError,
    get_pool,
    max_world_size,
    requires_world_size,
    run_distributed,
    shutdown_all_pools,
)

__all__ = ["DistRunner", "requires_world_size", "DistributedTestError", "DistributedTimeoutError"]


class DistRunner:
    """What the ``dist_runner`` / ``dist`` fixtures return."""

    def run(self, world_size: int, fn, *args, timeout: float = 120, **kwargs) -> list:
        if world_size > max_world_size():
            pytest.skip(f"world_size={world_size} > HP_TEST_MAX_WORLD_SIZE={max_world_size()}")
        return run_distributed(world_size, fn, *args, timeout=timeout, **kwargs)

    __call__ = run

    @staticmethod
    def pool(world_size: int):
        return get_pool(world_size)


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: test runs on the gloo worker pool")


@pytest.fixture(scope="session", autouse=True)
def _hp_worker_pools():
    yield
    shutdown_all_pools()


@pytest.fixture
def dist_runner(request) -> DistRunner:
    request.node.add_marker(pytest.mark.distributed)
    return DistRunner()


@pytest.fixture
def dist(dist_runner) -> DistRunner:
    return dist_runner
