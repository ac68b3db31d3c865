"""Session-wide rank pools (2 ranks by default, 4 for the few tests that need it)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from rank_pool import RankPool  # noqa: E402

pytest_plugins = ["suite_plugin"]  # issue 48: the closing figures, the subprocess mark, `make test-fast`

_pools: dict[int, RankPool] = {}


def _pool(world: int) -> RankPool:
    if world not in _pools:
        _pools[world] = RankPool(world)
    return _pools[world]


@pytest.fixture(scope="session")
def pool2() -> RankPool:
    return _pool(2)


@pytest.fixture(scope="session")
def pool4() -> RankPool:
    return _pool(4)


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    for p in _pools.values():
        p.close()
