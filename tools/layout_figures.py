"""The source tree's rooms and their share of the lines: where a newcomer's reading time goes.

Usage::

    python tools/layout_figures.py          # every room, largest first, with its lines and share

A room is what a reader opens as one thing: a package of ``shardwise/`` (its subpackages inside it), a
module loose at the top of ``shardwise/``, a topic folder of ``benchmarks/`` (or a script loose there),
and ``tools/``. Tests and examples are not rooms. Lines are the files' newline counts (what ``wc -l``
says). ``tests/test_package_layout.py`` holds the largest room to :data:`MAX_SHARE` of all the lines, and
finds the import cycles (between files of one package, and between benchmark scripts) that this leaves out.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("shardwise", "benchmarks", "tools")  # the folders whose Python files are rooms' lines
MAX_SHARE = 0.12  # no room holds more than this share of all the lines


def room_of(path: Path, root: Path = ROOT) -> str:
    """``shardwise/zero/`` for ``shardwise/zero/stage3/fetcher.py``; a loose module is its own room."""
    parts = path.relative_to(root).parts
    if parts[0] == "tools" or len(parts) == 2:
        return parts[0] + "/" if parts[0] == "tools" else "/".join(parts)
    return f"{parts[0]}/{parts[1]}/"


def room_lines(root: Path = ROOT) -> dict[str, int]:
    """Each room's lines, largest first."""
    lines: dict[str, int] = {}
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            room = room_of(path, root)
            lines[room] = lines.get(room, 0) + path.read_bytes().count(b"\n")
    return dict(sorted(lines.items(), key=lambda kv: (-kv[1], kv[0])))


def main() -> int:
    lines = room_lines()
    total = sum(lines.values())
    for room, n in lines.items():
        print(f"{n / total:6.1%} {n:6d}  {room}")
    largest = next(iter(lines))
    print(f"{len(lines)} rooms, {total} lines; the largest, {largest}, holds {lines[largest] / total:.1%} "
          f"(at most {MAX_SHARE:.0%})")
    return 0 if lines[largest] <= MAX_SHARE * total else 1


if __name__ == "__main__":
    sys.exit(main())
