"""The shared facade launch's failure path (tests/facade_launch.py), without starting one: a rank's
failure reply fails that part's test with the rank's traceback, and the next part asked for gets a
fresh launch, so a failing file does not fail the files after it.

The launch's processes are replaced by stand-ins here (a real launch costs ~15 CPU s, and the parts'
own tests run the real one); what is tested is the bookkeeping around them. The module's state is
swapped for the test's own (``monkeypatch``), so a real launch this pytest process holds is left alone.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import facade_launch  # noqa: E402


class _Running:
    """A launch process that has not ended."""

    def poll(self) -> None:
        return None


def _folder(root: Path) -> Path:
    for name in ("requests", "replies"):
        (root / name).mkdir(parents=True)
    for name in ("launch.out", "launch.err"):
        (root / name).write_text("")
    return root


def test_a_failed_rank_fails_its_part_with_the_traceback(tmp_path, monkeypatch) -> None:
    root = _folder(tmp_path)
    monkeypatch.setattr(facade_launch, "_launch", {"proc": _Running(), "root": root, "done": {}})

    def rank_1_fails() -> None:  # the ranks' side: the request appears, rank 1 answers with its failure
        while not (root / "requests" / "000-hf").exists():
            threading.Event().wait(0.01)
        (root / "replies" / "000-hf.failed1").write_text("rank 1:\nValueError: a broken part")

    answer = threading.Thread(target=rank_1_fails)
    answer.start()
    with pytest.raises(AssertionError, match=r"rank 1:.*ValueError: a broken part"):
        facade_launch._serve(root, "hf", timeout_s=60)
    answer.join()
    assert "hf" not in facade_launch._launch["done"]


def test_the_next_part_after_a_failure_gets_a_fresh_launch(tmp_path_factory, monkeypatch) -> None:
    starts, stops = [], []

    def start(root: Path) -> None:
        starts.append(root)
        (root / "launch.err").write_text("")
        facade_launch._launch.update(proc=_Running(), root=root, done={})

    def serve(root: Path, name: str) -> None:
        if name == "hf":
            raise AssertionError("rank 0:\nRuntimeError: the hf part broke")
        facade_launch._launch["done"][name] = f"{name} ran"

    monkeypatch.setattr(facade_launch, "_launch", {})
    monkeypatch.setattr(facade_launch, "_start", start)
    monkeypatch.setattr(facade_launch, "_serve", serve)
    monkeypatch.setattr(facade_launch, "_stop", lambda: stops.append(len(starts)))
    with pytest.raises(AssertionError, match="the hf part broke"):
        facade_launch.part(tmp_path_factory, "hf")
    assert len(starts) == 1 and stops == [1]  # the failed launch was ended
    got = facade_launch.part(tmp_path_factory, "trl")
    assert len(starts) == 2 and starts[1] != starts[0]  # a launch of its own, in a folder of its own
    assert got["root"] == starts[1] / "trl" and got["log"] == "trl ran"
    assert facade_launch.part(tmp_path_factory, "moe")["log"] == "moe ran" and len(starts) == 2  # shared again
