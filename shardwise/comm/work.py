"""A pending collective (:class:`Work`), and knowing without blocking that its communication is over.

Split from ``comm/core.py``: a collective in flight is a concept of its own. ``wait()`` finishes one:
it waits for the backend's handles, then runs the local ``finish`` (gloo's rank-order additions, a
copy-out). ``is_completed()`` says, without blocking, whether the handles are done, so that a caller
holding memory for a finished exchange (a stage-3 gradient bucket) can run that ``wait()`` early,
the same operations in the same order, only sooner (``zero/pending.py``, ``InflightLimit.make_room``).

The query is the backend's own where it is honest: NCCL's ``is_completed()`` queries the work's CUDA
event (no host sync), a gloo collective's turns true when gloo's worker thread has run it. gloo's
point-to-point sends and receives, which shardwise's gloo reduce-scatter is made of, are not: their
works complete only inside ``wait()`` (ProcessGroupGloo's SendWork/RecvWork), so they report False
however long ago the bytes arrived. For those :meth:`Work.watch` hands the handles to one watcher
thread per process, which waits for them (the GIL released) in the order they were watched and marks
the work done; ``wait()`` then joins that mark instead of waiting for the handles itself (a gloo
send or receive must be waited for once).
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.comm.parts import CommParts

_PENDING: weakref.WeakSet[Work] = weakref.WeakSet()  # collectives started and not yet waited for


def pending_works() -> list[Work]:
    """Collectives started and not yet waited for (the teardown waits for them at exit)."""
    return list(_PENDING)


class Work:
    """A pending collective (one handle or several); ``wait()`` finishes it and any copy-out.

    ``p2p``: the handles are gloo sends and receives, whose own ``is_completed()`` stays False until
    they are waited for; only a :meth:`watch` ed one can then say it is done. ``after``: the work this
    one's ``finish`` waits for first (a work made of another, such as the quantized reduce-scatter's),
    which answers the query for it."""

    def __init__(self, handle, comm: CommParts, kind: str, finish=None, p2p: bool = False,
                 after: Work | None = None):
        self._handles = handle if isinstance(handle, list) else ([] if handle is None else [handle])
        self._comm, self._kind, self._finish = comm, kind, finish
        self._p2p, self._after = p2p, after
        self._watch: _Watch | None = None
        self.on_done = None  # the comms logger's record of this collective (comm/log.py), once finished
        if self._handles:
            _PENDING.add(self)

    def watch(self) -> None:
        """Let :meth:`is_completed` see the end of a gloo point-to-point exchange (a no-op otherwise:
        every other backend's work answers the query itself)."""
        if self._after is not None:
            self._after.watch()
        if self._p2p and self._handles and self._watch is None:
            self._watch = _watcher().watch(self._handles, self._comm, self._kind)

    def is_completed(self) -> bool:
        """Is the communication over, so that ``wait()`` would only run the local finish? Never blocks.

        False when it cannot tell: a gloo exchange not :meth:`watch` ed, or a work made of others with
        no ``after`` to ask (the rank-order all-reduce's, whose finish starts another exchange)."""
        if not self._handles:
            if self._finish is None:
                return True
            return self._after is not None and self._after.is_completed()
        if self._p2p:
            return self._watch is not None and self._watch.done.is_set()
        return all(h.is_completed() for h in self._handles)

    def wait(self) -> None:
        if self._watch is not None:
            self._watch.done.wait()
            error, self._watch = self._watch.error, None
            if error is not None:
                raise error
        else:
            for h in self._handles:
                self._comm._guard(self._kind, h.wait)
        self._handles = []
        _PENDING.discard(self)
        if self._finish is not None:
            self._finish()
            self._finish = None
        if self.on_done is not None:
            self.on_done, done = None, self.on_done
            done()


class _Watch:
    """One watched work's mark: set once its handles are waited for (``error``: what the wait raised)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Watcher:
    """One daemon thread that waits for watched gloo sends and receives, in the order they were watched.

    The order is the one ``wait()`` would have used (a rank's reduce-scatters are waited for oldest
    first), so the thread adds no dependency between exchanges that waiting in place did not have."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def watch(self, handles: list, comm: CommParts, kind: str) -> _Watch:
        mark = _Watch()
        self._queue.put((list(handles), comm, kind, mark))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardwise-completion", daemon=True)
            self._thread.start()
        return mark

    def _run(self) -> None:
        while True:
            _wait_one(*self._queue.get())


def _wait_one(handles: list, comm: CommParts, kind: str, mark: _Watch) -> None:
    """Wait for one watched work's handles and mark it done. A function of its own so that nothing of it
    outlives the call: a gloo work holds its tensor (a gradient bucket or shard), which must not stay
    alive in this thread's frame while it sleeps on the next ``get()``.

    After one failure its group is unusable (``RanksDivergedError``): later works on that group get the
    error at once, so the thread never sits in a wait on a dead peer while the process ends (a thread
    returning from gloo into a finalizing interpreter aborts it). Works on another group, such as one
    made after the failed one was destroyed (a notebook that starts over), are waited for as usual."""
    group = _group_of(comm)
    failed = next((e for g, e in _FAILED if g is group), None)
    if failed is not None:
        mark.error = failed
        mark.done.set()
        return
    try:
        for h in handles:
            comm._guard(kind, h.wait)  # a failure is the diverged-ranks error, raised by wait()
    except BaseException as e:  # noqa: BLE001 (handed to the waiting thread, raised there)
        mark.error = e
        _FAILED.append((group, e))
    mark.done.set()


def _group_of(comm: CommParts) -> object:
    """The process group object a work runs on (``None`` in a Comm means the default group of the time)."""
    if comm.group is not None:
        return comm.group
    import torch.distributed as dist

    return dist.group.WORLD


_WATCHER: list[_Watcher] = []
_FAILED: list[tuple[object, BaseException]] = []  # (group, its first failed watched wait): unusable after it


def _watcher() -> _Watcher:
    if not _WATCHER:
        _WATCHER.append(_Watcher())
    return _WATCHER[0]


def _forget_watcher() -> None:
    """A forked child has no watcher thread (only the forking thread survives a fork): start anew."""
    _WATCHER.clear()
    _FAILED.clear()


os.register_at_fork(after_in_child=_forget_watcher)
