"""What every benchmark records beside its numbers: the machine, and where its results are kept.

A number without the CPU it was measured on cannot be compared with the next run's (docs/benchmarks.md
says why the CPU model matters on a shared machine), so each report's ``meta`` names it.
"""

from __future__ import annotations

import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results/: every topic's JSON files


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
