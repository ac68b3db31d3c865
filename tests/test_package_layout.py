"""The house rules of the source tree, read from the code (ast; only the Protocol check imports): one package
per concept, no import cycles, no private names across modules, short functions, benchmark topics that read alone,
no room holding more than its share of the lines (``python tools/layout_figures.py`` prints the shares).

A cycle is any loop in the graph of ``shardwise`` imports, a lazy import inside a function
included (it closes the loop as surely, only later); imports under ``if TYPE_CHECKING:`` are
left out (they never run), except in the check between files, which counts them as a reader does.
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` (its
``__init__``, the package's public face).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "shardwise"
MAX_LOOSE_MODULES = 6  # modules at the top of shardwise/ besides __init__, each with its reason in docs/architecture.md
MAX_FUNCTION_LINES = 60


def _module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # five checks read the library's trees: parsed once a process (~1 CPU s each time), never changed
def _modules(src: Path = SRC) -> dict[str, ast.Module]:
    return {_module_name(p, src): ast.parse(p.read_text(), str(p)) for p in sorted(src.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, annotations: bool = False):
    """Every import statement that can run, at any depth; TYPE_CHECKING blocks skipped unless ``annotations``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node) and not annotations:
            for child in node.orelse:
                yield from _imports(child)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _imports(node, annotations)


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")[: len(importer.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(modules: dict[str, ast.Module], src: Path = SRC, annotations: bool = False) -> dict[str, set[str]]:
    packages = {m for m in modules if (src.parent / m.replace(".", "/") / "__init__.py").exists()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, tree in modules.items():
        for node in _imports(tree, annotations):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _absolute(node, name, name in packages)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One loop per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    cycles = _cycles(_edges(_modules()))
    assert not cycles, f"import cycles (lazy imports count, TYPE_CHECKING ones do not): {cycles}"


def test_no_cycle_between_files_even_through_annotations() -> None:
    """Files stand in an order a reader can follow, inside a package too: none names a file that names it back
    through any chain, not even in an annotation (a TYPE_CHECKING import: it never runs, but the reader
    still has to know the other file first). A helper that needs the object calling it names a Protocol of
    what it reads instead (``engine/parts.py``, ``zero/stage3/parts.py``, ``comm/parts.py``)."""
    cycles = _cycles(_edges(_modules(), annotations=True))
    assert not cycles, f"files importing each other in a loop (annotation imports included): {cycles}"


PROTOCOLS = [("shardwise.engine.parts", "EngineParts", "shardwise.engine.engine", "Engine"),
             ("shardwise.zero.stage3.parts", "FetcherParts", "shardwise.zero.stage3.fetcher", "ParamFetcher"),
             ("shardwise.comm.parts", "CommParts", "shardwise.comm.core", "Comm")]


@pytest.mark.parametrize(("parts_module", "parts", "owner_module", "owner"), PROTOCOLS, ids=[p[1] for p in PROTOCOLS])
def test_the_owner_has_every_part_its_helpers_read(parts_module: str, parts: str, owner_module: str,
                                                   owner: str) -> None:
    """Each Protocol names only what its owner class has (a class attribute or method, or a ``self.x = ...``
    in one of its or its bases' methods), so typing a helper with it hides no missing member."""
    import importlib
    import inspect
    import textwrap

    proto = getattr(importlib.import_module(parts_module), parts)
    cls = getattr(importlib.import_module(owner_module), owner)
    wanted = set(proto.__annotations__) | {n for n, v in vars(proto).items() if callable(v) and n[:2] != "__"}
    have = set(dir(cls))
    for klass in cls.__mro__:
        if klass.__module__.startswith("shardwise."):
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
            have |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                     and isinstance(n.value, ast.Name) and n.value.id == "self"}
    assert len(wanted) > 1 and not wanted - have, sorted(wanted - have)


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph with every module folded into its top-level package (``shardwise.zero.stage3.fetcher``
    -> ``shardwise.zero``); a loose module is its own node."""
    top = {m: ".".join(m.split(".")[:2]) for m in graph}
    folded: dict[str, set[str]] = {p: set() for p in top.values()}
    for m, targets in graph.items():
        folded[top[m]] |= {top[t] for t in targets if top[t] != top[m]}
    return folded


def test_no_loop_between_packages() -> None:
    """Packages stand on floors: none imports one that imports it back, through any chain (lazy imports
    count, TYPE_CHECKING ones do not), so each can be read knowing only the floors below it."""
    loops = _cycles(_package_graph(_edges(_modules())))
    assert not loops, f"packages importing each other in a loop: {loops}"


def test_the_library_never_imports_the_command_line() -> None:
    """``shardwise/cli/`` is the top floor: it parses arguments and calls the library, never the other
    way, so a library function never depends on how a flag is spelled (lazy imports count too)."""
    graph = _edges(_modules())
    up = sorted(f"{m} -> {t}" for m, targets in graph.items() if not m.startswith("shardwise.cli")
                for t in targets if t == "shardwise.cli" or t.startswith("shardwise.cli."))
    assert not up, up


def test_no_private_names_imported_across_modules() -> None:
    offenders = []
    for name, tree in _modules().items():
        for node in _imports(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardwise"):
                offenders += [f"{name}: from {node.module} import {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert not offenders, offenders


def test_few_modules_loose_at_the_top() -> None:
    loose = sorted(p.name for p in SRC.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def test_no_function_over_60_lines() -> None:
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - first + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_cycle_finder_finds_a_lazy_cycle(tmp_path: Path) -> None:
    """The check can fail: a lazy import closing a loop is found, a TYPE_CHECKING one is not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text("from pkg.a import x\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import y\n")
    (pkg / "e.py").write_text("from pkg.d import z\n")
    assert _cycles(_edges(_modules(pkg), pkg)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_package_loop_finder_finds_a_loop_through_subpackages(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    for sub in ("a", "b", "b/deep"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from pkg.b.deep import y\n")
    (pkg / "b" / "deep" / "y.py").write_text("def f():\n    from pkg.a import z\n")
    (pkg / "a" / "z.py").write_text("")
    assert _cycles(_package_graph(_edges(_modules(pkg), pkg))) == [["pkg.a", "pkg.b"]]


def test_no_room_holds_more_than_its_share_of_the_lines() -> None:
    """No room (a package, a benchmark topic: ``tools/layout_figures.py`` says what a room is) holds more than
    12% of the lines: past that one room is where a newcomer spends the day, and it wants cutting in two."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("layout_figures", ROOT / "tools" / "layout_figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    lines = figures.room_lines()
    total = sum(lines.values())
    over = {room: f"{n / total:.1%}" for room, n in lines.items() if n > figures.MAX_SHARE * total}
    assert len(lines) > 20 and not over, over


BENCH = ROOT / "benchmarks"


def _benchmark_edges(bench: Path = BENCH) -> dict[str, set[str]]:
    """Which benchmark file imports which (lazy and annotation imports too). A script's own folder heads
    ``sys.path``, so a bare ``import x`` is the ``x.py`` beside it; ``import a.b`` (or ``from a import b``)
    is ``a/b.py`` under ``benchmarks/``, for the files that put ``benchmarks/`` on the path (``shared/``, ``gpu/``)."""
    files = {p.relative_to(bench).as_posix(): p for p in sorted(bench.rglob("*.py"))}
    graph: dict[str, set[str]] = {f: set() for f in files}
    for f, path in files.items():
        for node in _imports(ast.parse(path.read_text()), annotations=True):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.module:
                names += [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                stem = name.replace(".", "/") + ".py"
                graph[f] |= {c for c in ((Path(f).parent / stem).as_posix(), stem) if c in files and c != f}
    return graph


def test_benchmarks_import_no_cycle_and_only_their_topic_and_shared() -> None:
    """A topic folder of ``benchmarks/`` reads alone: its scripts import their own folder and the helpers
    in ``shared/``, never another topic's folder, and never in a loop (a loose entry at the top,
    ``gpu_check.py``, imports the folder it fronts)."""
    graph = _benchmark_edges()
    assert not _cycles(graph), _cycles(graph)
    across = sorted(f"{f} -> {t}" for f, targets in graph.items() for t in targets
                    if Path(f).parent != Path(t).parent and not t.startswith("shared/") and "/" in f)
    assert not across and graph["gpu_check.py"] == {"gpu/check.py"}, across


def test_benchmark_import_finder_reads_each_spelling(tmp_path: Path) -> None:
    for sub in ("a", "b", "shared"):
        (tmp_path / sub).mkdir()
    (tmp_path / "a" / "x.py").write_text("import y\n")
    (tmp_path / "a" / "y.py").write_text("def f():\n    from x import g\n")
    (tmp_path / "b" / "z.py").write_text("from shared.m import h\nfrom a import x\n")
    (tmp_path / "shared" / "m.py").write_text("")
    graph = _benchmark_edges(tmp_path)
    assert _cycles(graph) == [["a/x.py", "a/y.py"]] and graph["b/z.py"] == {"shared/m.py", "a/x.py"}


@pytest.mark.subprocess
def test_the_launcher_imports_no_torch() -> None:
    """``import shardwise``, ``shardwise --help`` and a script launch stay torch-free (the public names
    load on first use): importing torch in the launcher cost each ``shardwise launch`` ~4 s before any
    rank ran. Subpackages still resolve as attributes after a bare ``import shardwise``."""
    import subprocess
    import sys

    code = ("import sys, shardwise, shardwise.cli.command as cli\n"
            "ran = []\n"
            "cli._run_forwarding_signals = lambda cmd, env: ran.append(cmd) or 0\n"
            "assert cli.main(['--help']) == 0 and cli.main(['launch', '--nproc', '2', sys.argv[1]]) == 0, ran\n"
            "assert ran and ran[0][-1] == sys.argv[1], ran\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
            "assert callable(shardwise.initialize) and 'torch' in sys.modules\n"
            "assert shardwise.layout.__name__ == 'shardwise.layout' and not hasattr(shardwise, 'no_such_name')\n"
            "assert shardwise.checkpoint.__name__ == 'shardwise.checkpoint' and 'importlib' not in dir(shardwise)\n")
    r = subprocess.run([sys.executable, "-c", code, __file__], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


COLLECTIVE = ("all_", "broadcast", "reduce", "send", "recv", "isend", "irecv", "barrier", "gather", "scatter",
              "batch_isend", "monitored_barrier", "P2POp")


def _direct_collectives(src: Path = SRC) -> list[str]:
    """Calls of ``torch.distributed``'s collectives outside ``shardwise/comm/``: through an alias
    (``import torch.distributed as dist``), the full ``torch.distributed.x`` path, or a name imported
    from it (``from torch.distributed import all_reduce``)."""
    found = []
    for path in sorted(src.rglob("*.py")):
        if path.relative_to(src).parts[0] == "comm":
            continue
        tree = ast.parse(path.read_text())
        aliases, names = set(), set()
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
            elif node.module == "torch.distributed":
                names |= {a.asname or a.name for a in node.names if a.name.startswith(COLLECTIVE)}
            elif node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute | ast.Name):
                continue
            if isinstance(node, ast.Name):
                hit = node.id in names
            else:
                base = node.value
                hit = node.attr.startswith(COLLECTIVE) and (
                    (isinstance(base, ast.Name) and base.id in aliases)
                    or (isinstance(base, ast.Attribute) and base.attr == "distributed"
                        and isinstance(base.value, ast.Name) and base.value.id == "torch"))
                hit = hit and node.attr != "ReduceOp"
            if hit:
                found.append(f"{path.relative_to(src.parent)}:{node.lineno}")
    return found


def test_every_collective_goes_through_comm() -> None:
    """Collectives are called only in shardwise/comm/ (the guarded, counted ``Comm``): one outside it
    fails with a backend traceback instead of the diverged-ranks line, and its bytes go uncounted."""
    assert not _direct_collectives(), _direct_collectives()


def test_the_collective_finder_finds_each_spelling(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "comm").mkdir(parents=True)
    (pkg / "comm" / "core.py").write_text("import torch.distributed as dist\ndist.all_reduce(t)\n")
    (pkg / "a.py").write_text("import torch.distributed as dist\ndist.all_reduce(t, op=dist.ReduceOp.MAX)\n")
    (pkg / "b.py").write_text("import torch\ntorch.distributed.broadcast_object_list(box)\n")
    (pkg / "c.py").write_text("from torch.distributed import batch_isend_irecv as go\ngo(ops)\n")
    (pkg / "d.py").write_text("import torch.distributed as dist\nx = dist.get_rank(), dist.ReduceOp.SUM\n")
    assert _direct_collectives(pkg) == ["pkg/a.py:2", "pkg/b.py:2", "pkg/c.py:2"]
