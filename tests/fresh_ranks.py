"""Rank processes forked from a server that has already imported torch, transformers and shardwise.

A test whose subject is a rank *process* (its exit code as the OS sees it, SIGKILL, a timeout) but
not its imports starts it here instead of as ``python script.py``: multiprocessing's forkserver,
with the heavy modules preloaded, forks one process per rank, which saves the ~4.5 CPU s of imports
each fresh interpreter pays on this kind of host. Each rank:

- gets the environment the test gives it (``os.environ`` replaced before the entry runs; nothing
  that reads RANK, WORLD_SIZE, MASTER_* or FAULT* runs at import time), ``sys.argv`` and
  ``OMP_NUM_THREADS`` as a fresh process would (the server itself runs with the suite's
  ``OMP_NUM_THREADS=1`` and starts no thread before it forks: :func:`server_threads`);
- writes its stdout and stderr at the file-descriptor level into files (``dup2`` onto fds 1 and 2),
  so Python's output, faulthandler's dumps and C++ warnings are all captured;
- ends on the interpreter's own exit path: the entry's return value or ``SystemExit`` becomes the
  exit code with Python's rules (``None`` -> 0, an int -> itself, anything else printed, 1), an
  uncaught exception prints its traceback and sets ``sys.last_value`` (shardwise's atexit teardown
  reads it) and exits 1, then non-daemon threads are joined and the atexit handlers run, as
  ``Py_FinalizeEx`` does, and the streams are flushed. What a forked child skips is the rest of
  finalization (module teardown, C++ static destructors): a crash there would not show.
- reports its exit code like ``Popen``: negative for a signal (the server reaps it).

The signal handlers a rank starts with are those a fresh interpreter started from the test's process
would have (``fresh_signal_handlers``: what the test's process ignores stays ignored, the rest at their
defaults, SIGINT raising KeyboardInterrupt). Unlike fresh processes, every rank shares the server's
hash seed (``PYTHONHASHSEED``) and its already-initialised module state, reads stdin from /dev/null,
and is a multiprocessing child (``current_process().name`` is ``rank-R``, not ``MainProcess``).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing import forkserver
from pathlib import Path

HERE = Path(__file__).resolve().parent
# What the suite's forkserver imports before it forks anything: the union of what its users need (the
# fault and CLI ranks here, the rank pools of tests/rank_pool.py, the inference memory runs of
# tests/inference_cases.py), so whichever starts it first, each child starts with its imports done.
PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.models.mixtral.modeling_mixtral", "shardwise.cli.train", "shardwise.engine",
           "shardwise.train.run", "shardwise.inference.load", "fresh_ranks", "rank_pool", "fault_worker",
           "inference_cases"]


class Rank:
    """One forked rank: ``poll()``, ``kill()``, ``returncode`` and ``communicate()`` as ``Popen``'s."""

    def __init__(self, process: multiprocessing.process.BaseProcess, out: Path, err: Path) -> None:
        self.process, self.out, self.err = process, out, err

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        self.process.join(timeout)
        return self.process.exitcode

    def communicate(self) -> tuple[str, str]:
        """Wait for the end, then the captured stdout and stderr (text, undecodable bytes replaced)."""
        self.wait()
        return (self.out.read_text(errors="replace"), self.err.read_text(errors="replace"))


def context() -> multiprocessing.context.BaseContext:
    """multiprocessing's forkserver context, its server preloading ``PRELOAD``: one server per pytest
    process, started by its first user and never stopped before the process ends (the rank pools'
    ranks are its children: stopped, it could no longer report their exit codes or kill them)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))  # the server imports this module and the entry's by name
    ctx = multiprocessing.get_context("forkserver")
    modules = list(PRELOAD)
    if "pytest" in sys.modules:  # a child imports the parent's __main__ (pytest's) before its target
        modules.append("pytest")
    ctx.set_forkserver_preload(modules)  # read when the server starts; no effect once it runs
    return ctx


def start(entry: str, argv: list[str], env: dict[str, str], folder: Path) -> Rank:
    """Fork a rank running ``entry`` ("module:function", called with ``argv``) in ``env``; its
    output goes to ``folder``/stdout and ``folder``/stderr."""
    folder.mkdir(parents=True, exist_ok=True)
    out, err = folder / "stdout", folder / "stderr"
    process = context().Process(target=_child, args=(entry, list(argv), dict(env), str(out), str(err), ignored_here()),
                                name=f"rank-{env.get('RANK', '?')}")
    process.start()
    return Rank(process, out, err)


# What a new interpreter started from the test's process now would find: an ignored signal stays ignored
# across exec, any other starts at its default (SIGINT: Python's KeyboardInterrupt handler). The server
# restores its own start-up handlers in a child, and those are whatever its starter had when the suite
# first needed it (a test may have been ignoring SIGINT for a moment), so each rank sets them anew.
_RESET_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                  signal.SIGCHLD)


def ignored_here() -> list[int]:
    """The signals this process ignores now (a new interpreter started from it would ignore them too)."""
    return [int(s) for s in _RESET_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]


def fresh_signal_handlers(ignored: list[int]) -> None:
    """In a forked child: the handlers a new interpreter started with ``ignored`` ignored would have."""
    for sig in _RESET_SIGNALS:
        if int(sig) in ignored:
            signal.signal(sig, signal.SIG_IGN)
        else:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def _child(entry: str, argv: list[str], env: dict[str, str], out: str, err: str, ignored: list[int]) -> None:
    """The forked rank: environment, fds, argv and signal handlers of its own, the entry, then the
    interpreter's exit."""
    fresh_signal_handlers(ignored)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(new, fd)
        os.close(new)
    module, name = entry.split(":")
    sys.argv = [str(HERE / f"{module}.py"), *argv]
    code, interrupted = _run(getattr(importlib.import_module(module), name), argv)
    _finalize()
    if interrupted:  # as the interpreter does for an uncaught KeyboardInterrupt: die by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _run(fn: Callable[[list[str]], object], argv: list[str]) -> tuple[int, bool]:
    """``sys.exit(fn(argv))`` at the top of a script: (exit code, whether KeyboardInterrupt ended it)."""
    try:
        sys.exit(fn(argv))
    except SystemExit as e:
        if e.code is None:
            return 0, False
        if isinstance(e.code, int):
            return e.code & 0xFF, False
        print(e.code, file=sys.stderr)
        return 1, False
    except BaseException as e:  # noqa: BLE001 (what the interpreter does with an uncaught one)
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
        sys.excepthook(type(e), e, e.__traceback__)
        return 1, isinstance(e, KeyboardInterrupt)


def _finalize() -> None:
    """``Py_FinalizeEx``'s first steps: join non-daemon threads, run atexit handlers, flush."""
    threading._shutdown()  # noqa: SLF001 (the interpreter's own call before atexit)
    atexit._run_exitfuncs()  # noqa: SLF001 (a forked multiprocessing child would skip them)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def server_threads() -> int:
    """Threads of the running forkserver (from /proc): 1 means it forks without a thread to lose."""
    pid = forkserver._forkserver._forkserver_pid  # noqa: SLF001
    return len(os.listdir(f"/proc/{pid}/task"))


def probe(argv: list[str]) -> int:
    """What a rank starts with, as one JSON line on stdout (test_fresh_ranks.py compares a forked rank
    with a fresh interpreter): signal handlers and mask, faulthandler, threads, torch's thread count,
    environment and argv. ``argv[0]``: ``raise`` (an uncaught exception), ``kill`` (SIGKILL) or an exit
    code. An atexit handler reports on fd 2 whether ``sys.last_value`` is set, as shardwise's teardown
    reads it; faulthandler dumps this thread's stack into fd 2."""
    import faulthandler
    import json

    import torch

    def at_exit() -> None:
        os.write(2, f"atexit: last_value={type(getattr(sys, 'last_value', None)).__name__}\n".encode())

    atexit.register(at_exit)
    state = {"signals": {s.name: repr(signal.getsignal(s)) for s in
                         (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGUSR1)},
             "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
             "faulthandler": faulthandler.is_enabled(), "threads": threading.active_count(),
             "torch_threads": torch.get_num_threads(), "argv": sys.argv[1:],
             "env": {k: os.environ.get(k) for k in ("RANK", "OMP_NUM_THREADS", "PROBE")}}
    print(json.dumps(state))
    faulthandler.dump_traceback(all_threads=False)
    if argv[0] == "raise":
        raise RuntimeError("probe raised")
    if argv[0] == "kill":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return int(argv[0])
