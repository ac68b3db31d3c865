"""Run many `shardwise` CLI invocations in one process, each as `python -m shardwise.cli` would.

    python tests/cli_error_runner.py CASES.json RESULTS.json

CASES.json maps a name to an argv. Each case calls ``shardwise.cli.main(argv)`` with file
descriptor 2 pointed at a temporary file, so what the case writes to stderr (Python's and C++'s
alike) is captured as a subprocess would capture it; an exception escaping ``main`` is printed as
the interpreter would print it (a traceback, exit 1). Start-up and imports are paid once instead of
once per case: the cases all fail before any process group starts, so they share nothing else.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return int(exc.code or 0)
    print(exc.code, file=sys.stderr)  # sys.exit("message"): the interpreter prints it and exits 1
    return 1


def run_one(argv: list[str]) -> dict:
    from shardwise.cli import main

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as err:
        os.dup2(err.fileno(), 2)
        try:
            try:
                code = int(main(argv) or 0)
            except SystemExit as exc:
                code = _exit_code(exc)
            except BaseException:  # what the interpreter would print for an uncaught error
                traceback.print_exc()
                code = 1
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return {"returncode": code, "stderr": err.read().decode(errors="replace")}


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    results = {name: run_one(argv) for name, argv in cases.items()}
    with open(sys.argv[2], "w") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main()
