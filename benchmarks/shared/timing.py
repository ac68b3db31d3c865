"""Rounds of a transfer timed in one run: the median per way, as bytes per second, with every round shown
(on a shared machine the spread says whether a difference between two ways is one)."""

from __future__ import annotations

import statistics


def median_lines(times: dict[str, list[float]], nbytes: int, what: str) -> list[str]:
    """One line per way in ``times`` (seconds per round of ``nbytes`` bytes): its median and GB/s, its rounds."""
    lines = []
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"{name}: median {med:.3f} s for {nbytes >> 20} MiB{what}: {nbytes / med / 1e9:.2f} GB/s "
                     f"(rounds: {', '.join(f'{t:.3f}' for t in ts)})")
    return lines
