"""`make test-fast` covers every shardwise package, with tests that exist (tests/fast_subset.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from fast_subset import FAST, fast_ids, is_fast

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "shardwise"


def test_every_package_has_a_fast_test() -> None:
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages | {"shardwise"} == set(FAST), "a package without a fast test, or an entry for none"


def test_every_fast_entry_names_a_test_function_of_its_file() -> None:
    for test_id in fast_ids():
        file, name = test_id.split("::")
        tree = ast.parse((TESTS / file).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name.split("[")[0] in defined, test_id


def test_a_parametrized_entry_takes_its_cases_and_nothing_else() -> None:
    assert is_fast("tests/test_zero.py::test_a[2]", "test_zero.py::test_a")
    assert is_fast("tests/test_zero.py::test_a[2]", "test_zero.py::test_a[2]")
    assert not is_fast("tests/test_zero.py::test_a[3]", "test_zero.py::test_a[2]")
    assert not is_fast("tests/test_zero.py::test_ab", "test_zero.py::test_a")
