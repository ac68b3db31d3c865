"""The documentation's map holds: docs/README.md names every page by the question it answers, the pages stand
in docs/ with their figures and generated result pages in docs/figures/ and docs/results/, every relative link
of the README, the docs and the benchmarks' and examples' READMEs reaches a file, and every benchmark script the
docs, the tests and the scripts name exists where they say (read from the text, nothing run: a few milliseconds)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"
SUBFOLDERS = {"figures", "results"}
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
BENCH_PATH = re.compile(r"benchmarks/[a-z0-9_/]+\.py")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), ROOT / "benchmarks" / "README.md",
            ROOT / "examples" / "README.md"]


def relative_links(page: Path) -> list[str]:
    """The targets of the page's markdown links that point into the repository (code blocks left out)."""
    text = FENCED.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_every_relative_link_reaches_a_file() -> None:
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in _pages() for target in relative_links(page)
              if not (page.parent / unquote(target.split("#")[0])).exists()]
    assert not broken, broken


def test_the_index_names_every_page_figure_and_result_page() -> None:
    named = {(DOCS / unquote(t.split("#")[0])).resolve() for t in relative_links(INDEX)}
    files = [p for p in DOCS.rglob("*") if p.is_file() and p != INDEX]
    missing = sorted(str(p.relative_to(DOCS)) for p in files if p.resolve() not in named)
    assert not missing, f"docs/README.md does not name: {missing}"


def test_docs_top_holds_pages_only() -> None:
    """Figures and generated pages live in their subfolders, so the top of docs/ reads as the list of pages."""
    loose = sorted(p.name for p in DOCS.iterdir() if p.is_file() and p.suffix != ".md")
    folders = {p.name for p in DOCS.iterdir() if p.is_dir()}
    assert not loose and folders <= SUBFOLDERS, (loose, folders)


def test_every_benchmark_the_docs_name_exists() -> None:
    pages = _pages() + sorted((ROOT / "benchmarks").rglob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    named = {m for page in pages for m in BENCH_PATH.findall(page.read_text())}
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert len(named) > 20 and not missing, missing


def test_the_link_reader_reads_links() -> None:
    """Not vacuous: links are found, code blocks and web addresses are not taken for files."""
    page = ROOT / ".pytest_link_probe.md"
    try:
        page.write_text("[a](docs/x.md#h) [b](https://e.org) [c](#top)\n```\n[d](y.md)\n```\n")
        assert relative_links(page) == ["docs/x.md#h"]
    finally:
        page.unlink()
