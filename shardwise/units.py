"""Byte counts for people: ``4853350400`` prints as ``4.52 GiB``.

Only for printing: ``memory_report()``, ``comm_stats()`` and ``metrics.jsonl`` keep the raw
integers, so programs compare exact numbers and people read short ones.
"""

from __future__ import annotations

from collections.abc import Mapping

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units with three significant figures (``1536`` -> ``1.50 KiB``)."""
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(n)} B"
    return f"{value:.3g} {_UNITS[unit]}" if abs(value) >= 100 else f"{value:.2f} {_UNITS[unit]}"


def human_counts(counts: Mapping[str, float]) -> str:
    """``{"all_gather": 4853350400, ...}`` as ``all_gather 4.52 GiB, ...`` (zero entries left out)."""
    parts = [f"{k} {human_bytes(v)}" for k, v in counts.items() if v]
    return ", ".join(parts) if parts else "nothing"


class ByteCounts(dict):
    """A ``dict`` of byte counts (``memory_report()``, ``comm_stats()``) that prints in human units.

    The values stay the exact integers (compare, sum, ``json.dumps`` them as before); only
    ``print(report)`` / ``repr`` shows ``{'params': '1.50 MiB', ...}`` instead of ``1572864``.
    """

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k!r}: {human_bytes(v)!r}" for k, v in self.items()) + "}"

    __str__ = __repr__
