"""Session-wide rank pools (2 ranks by default, 4 for the few tests that need it)."""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Two tiers (docs/gpu_first_hour.md). The CPU tier, every test not marked `gpu`, runs with the GPUs
# hidden, set before torch is imported and inherited by every rank pool and subprocess: its ranks are
# CPU ranks on gloo on a GPU machine too. `make test-gpu` (SHARDWISE_TEST_GPU=1) runs the `gpu` tier.
GPU_TIER = os.environ.get("SHARDWISE_TEST_GPU") == "1"
if not GPU_TIER:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

from rank_pool import RankPool  # noqa: E402

# issue 48: closing figures, marks, files to xdist workers; no writes into the checkout
pytest_plugins = ["suite_plugin", "tree_guard", "worker_plan"]

_pools: dict[int, RankPool] = {}


def _pool(world: int) -> RankPool:
    if world not in _pools:
        _pools[world] = RankPool(world, warm=True)
    return _pools[world]


# What a launcher (or shardwise's world of one) puts in the environment. A test that initializes in
# pytest's own process (the device guard, the engine-surface tests) leaves RANK=0 and a MASTER_PORT its
# live store listens on; a later file's subprocess copying os.environ would inherit that rendezvous and
# be refused ("started from inside a running job"), an order-dependent failure under pytest-xdist.
LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True, scope="module")
def launcher_environment_ends_with_its_file():
    """Each test file starts with the launcher variables pytest started with (the process group, if a
    file made one, stays: later in-process code finds it initialized and reads the defaults)."""
    before = {key: os.environ.get(key) for key in LAUNCHER_KEYS}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True, scope="module")
def earlier_objects_frozen():
    """Each file starts with what is alive now (torch, transformers, the collected tests, earlier files'
    caches) left out of the garbage collector's walks: with ~1M objects a full collection cost this
    process 0.2-0.3 CPU s, a dozen times per hundred tests. Garbage is collected first, so nothing dead
    is kept; what the file makes stays collectable. (The pools' ranks freeze their heap too: rank_pool.)"""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(scope="session")
def pool1() -> RankPool:
    """A world of one (a rank of its own, so a case's process group never lives in pytest's process)."""
    return _pool(1)


@pytest.fixture(scope="session")
def pool2() -> RankPool:
    return _pool(2)


@pytest.fixture(scope="session")
def pool4() -> RankPool:
    return _pool(4)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; runs in the GPU tier (`make test-gpu`), skipped elsewhere")


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ARG001
    """Each tier skips the other's tests, saying why (the GPU tier also where torch sees no GPU)."""
    if GPU_TIER:
        import torch

        no_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="torch sees no GPU here")
        cpu_tier = pytest.mark.skip(reason="CPU tier test: run it without SHARDWISE_TEST_GPU (GPUs hidden)")
        for item in items:
            mark = no_gpu if item.get_closest_marker("gpu") else cpu_tier
            if mark is not None:
                item.add_marker(mark)
        return
    hidden = pytest.mark.skip(reason="GPU tier: `make test-gpu` runs it (tests/conftest.py hides CUDA from the rest)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(hidden)


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    for p in _pools.values():
        p.close()
