"""User errors on the command line: one line on stderr, exit code 2, never a traceback.

A user error is bad input (a flag, a file, a config) that the user fixes by changing the command.
The CLI catches exactly these types at its top level (:func:`run_command`); anything else is a bug
and keeps its traceback. Library code raises :class:`UserError` (or the project's own
``ConfigError`` / ``CheckpointError``) with a message that says what is wrong and what to do.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

EXIT_USAGE = 2  # argparse's code for bad usage; every user error of `shardwise` exits with it


class OneLineError(Exception):
    """The base of every error whose message is for the user: :class:`UserError`, and the
    project's own ``ConfigError`` and ``CheckpointError`` derive from it, so the CLI knows them
    without importing the packages that raise them (which would close an import cycle)."""


class UserError(ValueError, OneLineError):
    """Bad user input; the message names the flag, key or file and the fix."""


class UsageError(RuntimeError, AssertionError):
    """A call DeepSpeed refuses with an ``assert``: an AssertionError for scripts and tests written
    for DeepSpeed, a RuntimeError for everyone else. Here, not in ``engine/``, because the config's
    combination check (``config/combinations.py``) refuses two ``initialize`` arguments with it."""


class CheckpointError(RuntimeError, OneLineError):
    """A checkpoint is missing, corrupt, truncated, or does not fit the engine it is loaded into.

    Here, not in ``checkpoint/``, because the readers of model folders below the checkpoint code
    (``files/``, zero.Init's folder reader) raise it too; ``checkpoint`` hands it on by name."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception types the CLI reports as one line."""
    return (OneLineError,)


def one_line(text: object) -> str:
    """Collapse a (possibly multi-line) message to one line."""
    return " ".join(str(text).split())


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (no usage block) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see `{self.prog} --help`)\n")


def bounded_int(low: int, high: int, what: str = "value") -> Callable[[str], int]:
    """An argparse ``type``: an integer in [low, high], else a one-line error naming the range."""

    def conv(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high:,}, got {value:,}")
        return value

    conv.__name__ = what
    return conv


def positive_float(text: str) -> float:
    """An argparse ``type`` for a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 (and < 1e9), got {text!r}")
    return value


def finite_float(low: float, high: float, what: str = "value", low_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in [low, high] (``(low, high]`` with ``low_open``)."""

    def conv(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (low < value <= high if low_open else low <= value <= high):
            raise argparse.ArgumentTypeError(f"must be in {'(' if low_open else '['}{low}, {high}], got {text!r}")
        return value

    conv.__name__ = what
    return conv


def run_command(prog: str, entry: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """Run one subcommand; a user error becomes one line on stderr and exit code 2."""
    errors = user_error_types()
    try:
        return int(entry(argv) or 0)
    except errors as exc:
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr, flush=True)
        return EXIT_USAGE
