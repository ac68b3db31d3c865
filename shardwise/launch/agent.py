"""torchrun's agent as ``shardwise launch`` runs it: the same launch, failures in one line.

torchrun ends a failed job with ``ChildFailedError``: a traceback of the agent plus a 30-line
report, and exit code 1 whatever the ranks said. Here the agent runs in-process
(``torch.distributed.run.run``) and its failure is read instead:

- the first rank to fail exited with a code of ``shardwise``'s own (2: a user error, 3: training
  diverged, 4: a rank failed: a broken collective, a dead or stalled peer, out of memory) while
  running a shardwise subcommand: that rank already printed its one line, so the launcher adds
  nothing and exits with the same code;
- any other failure (a script's exception, a signal): one line naming the rank, its exit code or
  signal and where its output is; the exit code is the rank's (1 after a signal); the rank's own
  traceback, printed above it, is the detail;
- a rank killed by a signal (SIGKILL: "killed; out of host memory?") is always named, also when its
  peers then exited first with a code of their own (4: "a peer process died"): that code is kept;
- the master port already in use: one line naming the port and how to pick another, exit 2.
"""

from __future__ import annotations

import logging
import sys

from shardwise.launch.net import address_in_use, port_taken

ONE_LINE_CODES = (2, 3, 4)  # shardwise subcommands print their own one line before exiting with these
QUIET_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",)  # "failed (exitcode: 2)", "Sending SIGTERM"


def how_killed(signum: int, name: str) -> str:
    """``signal 9 (SIGKILL: killed; out of host memory?)``: the signal and what usually sent it."""
    why = {9: "killed; out of host memory?", 15: "terminated", 6: "aborted", 11: "segmentation fault",
           7: "bus error; shared memory (/dev/shm) full?"}.get(signum)
    return f"signal {signum} ({name}{': ' + why if why else ''})"


def _rank_words(rank: int, failure) -> str:
    return f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"


def failure_line(exc, subcommand: bool) -> tuple[str | None, int]:
    """(the line(s) to print, or None; the exit code) for torchrun's ``ChildFailedError``.

    A rank killed by a signal (the OOM killer's SIGKILL) prints nothing itself, and its peers then
    fail their next collective: they exit first or in the same poll of the agent, with a code of
    their own (4, "a peer process died"), and torchrun's first failure (its timestamps are whole
    seconds, ties go to the lowest rank) is a survivor. So every rank killed by a signal is named
    here, whichever failure torchrun calls first, and the exit code stays the survivors' choice.
    Once one rank failed the agent stops the others with SIGTERM, and lists them too: a SIGTERM
    beside another failure is the agent's own, not news.
    """
    rank, failure = exc.get_first_failure()
    code = failure.exitcode
    failures = sorted(exc.failures.items())
    if any(f.exitcode != -15 for _, f in failures):
        failures = [(r, f) for r, f in failures if f.exitcode != -15]
        if failure.exitcode == -15:
            rank, failure = failures[0]
            code = failure.exitcode
    killed = [(r, f) for r, f in failures if f.exitcode < 0]
    if code < 0 or not killed:
        if code in ONE_LINE_CODES and subcommand:
            return None, code
        what = f"was killed by {how_killed(-code, failure.signal_name())}" if code < 0 else f"exited with code {code}"
        where = f"; error file {failure.error_file}" if failure.error_file and failure.error_file != "<N/A>" else ""
        first = f"{_rank_words(rank, failure)} {what}{where}; its output is above"
        others = [f"{_rank_words(r, f)} was killed by {how_killed(-f.exitcode, f.signal_name())}"
                  for r, f in killed if r != rank]
        return "; ".join([first, *others]), code if code > 0 else 1
    lines = [f"{_rank_words(r, f)} was killed by {how_killed(-f.exitcode, f.signal_name())}" for r, f in killed]
    return (f"{'; '.join(lines)}; the other ranks' errors (exit code {code}) follow from it"), code


def main(argv: list[str] | None = None) -> int:
    """Run torchrun's agent with ``argv`` (torchrun's own arguments)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = list(sys.argv[1:] if argv is None else argv)
    subcommand = argv[:1] == ["--subcommand"]
    argv = argv[1:] if subcommand else argv
    args = get_args_parser().parse_args(argv)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as exc:
        line, code = failure_line(exc, subcommand)
        if line is not None:
            print(f"shardwise launch: error: {line}", file=sys.stderr, flush=True)
        return code
    except Exception as exc:
        if not address_in_use(exc):
            raise
        msg = port_taken(args.master_port, "pass another --master-port, or leave it out on one node (a free "
                                             "port is chosen)")
        print(f"shardwise launch: error: --master-port {args.master_port}: {msg}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
