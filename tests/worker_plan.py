"""How `make test` hands test files to its two pytest-xdist workers (issue 48), loaded by tests/conftest.py.

Two rules, ordering and grouping only (every test runs, each exactly once):

* **Files that share a per-process resource go to one worker together.** The shared `--as-deepspeed`
  launch (tests/facade_launch.py: two ranks and a launcher that import torch, transformers, PEFT,
  Accelerate and TRL, ~15 CPU s) is made once per pytest process, by the first file that asks for a
  part. Spread over both workers it starts twice; grouped, once. A file joins the group when its
  source names the resource; files that name two resources merge their groups. (The rank pools and
  the forked fresh ranks are not listed: their ranks fork from the suite's forkserver with the
  imports done, so a second worker's start costs a fork and a rendezvous, and grouping their 30-odd
  files would only make the work units coarser.)
* **Longest first.** The groups, then the files that take longest (`LONGEST_FILES`, wall seconds on 2
  quiet cores), are handed out first, so the run does not end with one worker busy on a long file
  while the other waits. xdist's own reordering (by a file's number of tests) would undo it:
  `make test` passes `--no-loadscope-reorder`.
* **The file that loads every core by itself goes last** (`LAST_FILES`): tests/test_launch_exit.py
  runs its 2-rank launches side by side with a busy loop (the load its abort needed). Beside a pool
  test it tripled that test's wall time (a `torch.compile` case: 9 s alone, 31 s beside it); last, it
  fills the cores the other worker leaves as the run ends. (Split in two files, both went to the
  same worker one after the other: xdist hands a worker its next file while it runs one.)
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# a resource made once per pytest process -> the words in a test file's source that show it uses it
SHARED_RESOURCES = {"the shared facade launch": r"\bfacade_launch\b"}

LONGEST_FILES = ("test_inference.py", "test_rank_faults.py", "test_loops.py", "test_train_job.py",
                 "test_launch.py", "test_doc_commands.py", "test_gpu_check.py", "test_stage3.py",
                 "test_zeropp.py", "test_exports.py", "test_stage3_lean.py", "test_inference_quant.py",
                 "test_multinode.py", "test_hf_cpu_unchanged.py", "test_device_guard.py", "test_whole_tensor.py",
                 "test_zero.py", "test_device_guard_paths.py", "test_examples.py")


LAST_FILES = ("test_launch_exit.py",)


@functools.cache
def resource_groups() -> tuple[frozenset[str], ...]:
    """The groups of test file names that must share a worker, the group of most files first."""
    users = {name: {f.name for f in TESTS.glob("test_*.py") if re.search(pattern, f.read_text())}
             for name, pattern in SHARED_RESOURCES.items()}
    groups: list[set[str]] = []
    for files in users.values():
        touching = [g for g in groups if g & files]
        merged = set(files).union(*touching)
        groups = [g for g in groups if not g & files] + [merged]
    return tuple(frozenset(g) for g in sorted(groups, key=lambda g: (-len(g), sorted(g))) if len(g) > 1)


def scope_of(file_name: str) -> str:
    """The unit a worker receives: a resource group's name, or the file itself."""
    for i, group in enumerate(resource_groups()):
        if file_name in group:
            return f"shared resource group {i}"
    return file_name


def hand_out_order(file_name: str) -> int:
    """Sort key for a worker's collection (the order the controller hands scopes out)."""
    groups = resource_groups()
    for i, group in enumerate(groups):
        if file_name in group:
            return i
    if file_name in LAST_FILES:
        return len(groups) + len(LONGEST_FILES) + 1 + LAST_FILES.index(file_name)
    longest = {name: i for i, name in enumerate(LONGEST_FILES)}
    return len(groups) + longest.get(file_name, len(longest))


def pytest_collection_modifyitems(config, items) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: its order is the order files are handed out
        items.sort(key=lambda item: hand_out_order(item.path.name))  # stable: a file's tests keep their order


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with resource groups: one scope per group instead of one per file."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ResourceGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(Path(super()._split_scope(nodeid)).name)

    return ResourceGroupScheduling(config, log)
