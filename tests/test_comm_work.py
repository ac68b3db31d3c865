"""A watched collective's failure (shardwise/comm/work.py): later works on the broken group fail at once,
works on another group are still waited for (a group made after the failed one was destroyed must not
inherit its error). The handles and the Comm are stand-ins: what is tested is the watcher's bookkeeping."""

from __future__ import annotations

import pytest

import shardwise.comm.work as work_module
from shardwise.comm.work import Work


class _Comm:
    def __init__(self, group: object) -> None:
        self.group = group

    def _guard(self, kind: str, fn) -> None:
        fn()


class _Handle:
    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.waited = error, False

    def wait(self) -> None:
        self.waited = True
        if self.error is not None:
            raise self.error


def _watched(handle: _Handle, comm: _Comm) -> Work:
    w = Work([handle], comm, "reduce_scatter", p2p=True)
    w.watch()
    return w


def test_a_failed_group_fails_its_later_works_and_no_other_group(monkeypatch) -> None:
    monkeypatch.setattr(work_module, "_FAILED", [])  # this process's record of failed groups, for this test only
    broken, fresh = _Comm(object()), _Comm(object())
    with pytest.raises(RuntimeError, match="peer gone"):
        _watched(_Handle(RuntimeError("peer gone")), broken).wait()
    later = _Handle()
    with pytest.raises(RuntimeError, match="peer gone"):
        _watched(later, broken).wait()
    assert not later.waited  # not waited on: its peer is gone
    ok = _Handle()
    _watched(ok, fresh).wait()  # another group: waited for, no error
    assert ok.waited
