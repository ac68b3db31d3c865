"""The suite's own figures and marks (issue 48), loaded by tests/conftest.py.

* ``subprocess``: a test whose subject is a process of its own (a CLI exit code, a one-line
  error, a signal, a kill, a launch). Everything else runs in this process or in the shared
  rank pools (tests/rank_pool.py). A test that starts a subprocess without the mark is named at
  the end of the run, so the list stays honest.
* The closing section of every run: how many subprocess tests and their total seconds, how often
  the rank pools started and how long tests waited for them, and every unmarked test over 20 s
  of its own work (pool start-up left out): those belong in a pool, or in the subprocess list.
* ``fast`` (`make test-fast`): the tests tests/fast_subset.py names; under ``-m fast`` only
  their files are collected, and an entry naming no collected test is an error.
"""

from __future__ import annotations

import os

import pytest
from rank_pool import RankPool

_SPAWNED: dict[str, float] = {}  # test id -> seconds, for tests that started a process of their own
_UNMARKED: dict[str, set[str]] = {}  # test id -> programs it started without the `subprocess` mark
_UNMARKED_HERE: dict[str, set[str]] = {}  # the same, seen in this process, until its report carries them
# what libraries start for themselves (ctypes.util.find_library asks ldconfig, gcc or ld; platform asks uname):
# not a test's process
_INCIDENTAL = {"ldconfig", "gcc", "cc", "ld", "objdump", "uname", "nvidia-smi"}
_CURRENT: list = [None]  # the test item running now (setup, call or teardown)
_SLOW: dict[str, float] = {}  # test id -> seconds, for the tests without the mark (issue 48: none over 20 s)
SLOW_S = 20.0
_POOL_WAIT: dict[str, float] = {}  # test id -> seconds it waited for a rank pool to start (not its own work)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "subprocess: the test's subject is a process of its own (a CLI exit "
                            "code, a one-line error, a signal, a kill, a launch); counted at the end of the run")
    config.addinivalue_line("markers", "fast: in `make test-fast`, the inner loop that covers every package once")
    import subprocess

    start = subprocess.Popen._execute_child

    def noting_child(self, args, *rest, **kwargs):  # a test that starts a process without saying so is named
        item = _CURRENT[0]
        program = os.path.basename(str(args if isinstance(args, (str, bytes, os.PathLike)) else args[0]))
        if item is not None and item.get_closest_marker("subprocess") is None and program not in _INCIDENTAL:
            _UNMARKED_HERE.setdefault(item.nodeid, set()).add(program)
        return start(self, args, *rest, **kwargs)

    subprocess.Popen._execute_child = noting_child


_POOLS = {"starts": 0, "wait_s": 0.0}  # summed from every test's report (the pools live in the workers)
_AT_START: dict[str, tuple[int, float]] = {}  # test id -> (RankPool.starts, RankPool.start_s) when it began


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001
    _CURRENT[0] = item
    _AT_START[item.nodeid] = (RankPool.starts, RankPool.start_s)
    yield
    _CURRENT[0] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The figures a test's process saw ride on its teardown report (``user_properties``), so the
    process that prints them sees them too when the suite runs on pytest-xdist workers."""
    if call.when == "teardown":
        starts, start_s = _AT_START.pop(item.nodeid, (RankPool.starts, RankPool.start_s))
        item.user_properties += [("pool_starts", RankPool.starts - starts),
                                 ("pool_wait_s", RankPool.start_s - start_s),
                                 ("unmarked_programs", sorted(_UNMARKED_HERE.pop(item.nodeid, set())))]
    yield


def pytest_runtest_logreport(report) -> None:
    seconds = _SPAWNED if "subprocess" in report.keywords else _SLOW
    seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + report.duration
    props = dict(report.user_properties) if report.when == "teardown" else {}
    if "pool_wait_s" in props:
        _POOLS["starts"] += props["pool_starts"]
        _POOLS["wait_s"] += props["pool_wait_s"]
        _POOL_WAIT[report.nodeid] = props["pool_wait_s"]
        if props["unmarked_programs"]:
            _UNMARKED.setdefault(report.nodeid, set()).update(props["unmarked_programs"])


@pytest.hookimpl(trylast=True)  # after the slowest durations, the last lines of the run
def pytest_terminal_summary(terminalreporter, config) -> None:
    if config.option.collectonly:
        return
    write = terminalreporter.write_line
    terminalreporter.section("subprocess tests and rank pools")
    write(f"{len(_SPAWNED)} subprocess tests (marked `subprocess`) took {sum(_SPAWNED.values()):.1f} s in all")
    write(f"rank pools: {_POOLS['starts']} starts, {_POOLS['wait_s']:.1f} s waiting for ranks to join")
    for nodeid, programs in sorted(_UNMARKED.items()):
        write(f"started a subprocess without the `subprocess` mark: {nodeid} ({', '.join(sorted(programs))})")
    for nodeid, s in sorted(_SLOW.items(), key=lambda kv: -kv[1]):
        own = s - _POOL_WAIT.get(nodeid, 0.0)  # setup + call + teardown (a module fixture lands on its first test)
        if own > SLOW_S:
            write(f"over {SLOW_S:.0f} s without the `subprocess` mark: {own:.1f} s {nodeid}")



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
