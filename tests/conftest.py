"""Session-wide rank pools (2 ranks by default, 4 for the few tests that need it)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from rank_pool import RankPool  # noqa: E402

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


# --- issue 48: the suite's own figures (subprocess tests, rank pool starts), printed at the end ---

_SPAWNED: dict[str, float] = {}  # test id -> seconds, for tests that started a process of their own
_UNMARKED: set[str] = set()  # tests that started a subprocess without the `subprocess` mark
_CURRENT: list = [None]  # the test item running now (setup, call or teardown)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "subprocess: the test's subject is a process of its own (a CLI exit "
                            "code, a one-line error, a signal, a kill, a launch); counted at the end of the run")
    config.addinivalue_line("markers", "fast: in `make test-fast`, the inner loop that covers every package once")
    import subprocess

    start = subprocess.Popen._execute_child

    def noting_child(self, *args, **kwargs):  # a test that starts a process without saying so is named
        item = _CURRENT[0]
        if item is not None and item.get_closest_marker("subprocess") is None:
            _UNMARKED.add(item.nodeid)
        return start(self, *args, **kwargs)

    subprocess.Popen._execute_child = noting_child


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001
    _CURRENT[0] = item
    yield
    _CURRENT[0] = None


def pytest_runtest_logreport(report) -> None:
    if "subprocess" in report.keywords:
        _SPAWNED[report.nodeid] = _SPAWNED.get(report.nodeid, 0.0) + report.duration


@pytest.hookimpl(trylast=True)  # after the slowest durations, the last lines of the run
def pytest_terminal_summary(terminalreporter, config) -> None:
    if config.option.collectonly:
        return
    write = terminalreporter.write_line
    terminalreporter.section("subprocess tests and rank pools")
    write(f"{len(_SPAWNED)} subprocess tests (marked `subprocess`) took {sum(_SPAWNED.values()):.1f} s in all")
    write(f"rank pools: {RankPool.starts} starts, {RankPool.start_s:.1f} s waiting for ranks to join")
    for nodeid in sorted(_UNMARKED):
        write(f"started a subprocess without the `subprocess` mark: {nodeid}")


# --- issue 48: `make test-fast` (-m fast): the subset tests/fast_subset.py names, and only its files ---

def _fast_only(config) -> bool:
    return (config.option.markexpr or "").strip() == "fast"


def pytest_ignore_collect(collection_path, config):
    if _fast_only(config) and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        from fast_subset import fast_files

        return collection_path.name not in fast_files() or None
    return None


def pytest_collection_modifyitems(config, items) -> None:
    from fast_subset import fast_ids, is_fast

    found = set()
    for item in items:
        for test_id in fast_ids():
            if is_fast(item.nodeid, test_id):
                item.add_marker(pytest.mark.fast)
                found.add(test_id)
    missing = [t for t in fast_ids() if t not in found]
    if _fast_only(config) and missing:
        raise pytest.UsageError(f"tests/fast_subset.py names tests that were not collected: {missing}")
