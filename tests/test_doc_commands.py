"""Every shell block marked runnable in README.md and docs/*.md runs, as written, in order per page.

The marker is the fence's info string: a block opened with three backticks followed by
``bash runnable`` (renderers use the first word for highlighting and ignore the rest). Mark only
quick commands (seconds, a few training steps): this test runs them all. Each page runs in a fresh
folder that sees the repository's ``data/`` and ``examples/`` (so ``runs/`` lands there, not in the
checkout), with this interpreter's ``shardwise`` command first on PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# what a launcher sets; the blocks run as from a user's shell, never inside an earlier test's job
LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```bash runnable[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def runnable_blocks(text: str) -> list[str]:
    return [m.group(1) for m in FENCE.finditer(text)]


PAGES_WITH_BLOCKS = [p for p in PAGES if runnable_blocks(p.read_text())]


def test_the_marker_is_found() -> None:
    """Not vacuous: the README and the tutorial carry runnable blocks, and the pattern reads them."""
    names = {p.name for p in PAGES_WITH_BLOCKS}
    assert {"README.md", "tutorial.md"} <= names, names
    assert runnable_blocks("x\n```bash runnable\necho hi\n```\n```bash\nno\n```\n") == ["echo hi\n"]


@pytest.mark.parametrize("page", PAGES_WITH_BLOCKS, ids=lambda p: p.name)
@pytest.mark.subprocess
def test_runnable_commands(page: Path, tmp_path: Path) -> None:
    for name in ("data", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    fresh_shell = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    env = {**fresh_shell, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for i, block in enumerate(runnable_blocks(page.read_text())):
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"{page.name}, runnable block {i + 1}:\n{block}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
