"""How long `shardwise SUBCOMMAND --help` takes, as a ratio to starting Python at all (`python -c pass`).

A ratio, not seconds: on a loaded machine both grow together, so the ratio says what the command
adds over the interpreter's own start (the help used to import torch and transformers first: a
ratio in the hundreds). Each command runs ``--repeats`` times, the median is kept.

    .venv/bin/python benchmarks/cli/bench_help.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = ["", "launch", "train", "estimate", "consolidate", "generate", "quantize", "env"]


def _median_seconds(argv: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    base = _median_seconds([sys.executable, "-c", "pass"], args.repeats)
    print(f"python -c pass: {base * 1e3:.0f} ms (median of {args.repeats})")
    print(f"{'command':<34} {'ms':>7} {'ratio':>7}")
    for cmd in COMMANDS:
        argv = [sys.executable, "-m", "shardwise.cli", *([cmd] if cmd else []), "--help"]
        t = _median_seconds(argv, args.repeats)
        print(f"{('shardwise ' + cmd).strip() + ' --help':<34} {t * 1e3:>7.0f} {t / base:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
