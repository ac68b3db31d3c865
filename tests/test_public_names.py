"""Every public name the README and docs/ show resolves: ``from shardwise... import a, b`` lines in
code blocks, and backticked dotted names ``shardwise.x.y`` in the text (config keys such as
``shardwise.timeout_s``, which are JSON paths, not Python names, are left out)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from shardwise.config.keys import BY_PATH

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FROM_IMPORT = re.compile(r"^\s*from (shardwise[\w.]*) import ([\w, ()]+)", re.M)
DOTTED = re.compile(r"`(shardwise(?:\.\w+)+)")


def _resolve(dotted: str) -> object:
    """The object ``a.b.c`` names, as Python finds it: an attribute, else a submodule to import."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, attr in enumerate(parts[1:], start=2):
        obj = getattr(obj, attr) if hasattr(obj, attr) else importlib.import_module(".".join(parts[:i]))
    return obj


def _names() -> list[str]:
    found: set[str] = set()
    for doc in DOCS:
        text = doc.read_text()
        for module, names in FROM_IMPORT.findall(text):
            found |= {f"{module}.{n.strip()}" for n in names.strip("()").split(",") if n.strip()}
        found |= {d for d in DOTTED.findall(text) if d not in BY_PATH and d.split(".")[1] not in ("json", "md")}
    return sorted(found)


def test_the_docs_name_public_things() -> None:
    assert len(_names()) > 20  # the scan finds the docs' names (a broken regex would pass vacuously)


@pytest.mark.parametrize("dotted", _names())
def test_public_name_resolves(dotted: str) -> None:
    _resolve(dotted)
