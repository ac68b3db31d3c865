"""The import machinery of the facade: ``deepspeed`` and every ``deepspeed.*`` path resolve to
modules built from :data:`~shardwise.deepspeed.surface.SURFACE`, and ``importlib.metadata``
finds a ``deepspeed`` distribution whose version is the facade's.

A meta-path finder placed first on ``sys.meta_path`` answers for the whole ``deepspeed`` name
space, so an installed DeepSpeed is never imported once the facade is installed. A path the
table does not list still imports (libraries import names they never use); its attributes are
stand-ins that raise, naming the DeepSpeed name, when used (see ``missing.py``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
import types
from pathlib import Path
from typing import Any

from shardwise.deepspeed.missing import missing_name
from shardwise.deepspeed.surface import SURFACE, VERSION

ROOT = "deepspeed"


def _is_facade_name(fullname: str) -> bool:
    return fullname == ROOT or fullname.startswith(ROOT + ".")


class FacadeModule(types.ModuleType):
    """One ``deepspeed.*`` module: its table's names, its submodules, stand-ins for the rest."""

    def __init__(self, name: str):
        super().__init__(name, f"shardwise's DeepSpeed facade for {name}")
        self.__dict__.update(SURFACE.get(name, {}))

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        sub = f"{self.__name__}.{attr}"
        if sub in SURFACE or sub in sys.modules:
            return importlib.import_module(sub)
        return missing_name(sub)

    def __dir__(self) -> list[str]:
        subs = {m[len(self.__name__) + 1:].split(".")[0] for m in SURFACE if m.startswith(self.__name__ + ".")}
        return sorted(set(super().__dir__()) | subs)


class FacadeDistribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution the facade stands for (``importlib.metadata.version``)."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {VERSION}\n"
                    "Summary: shardwise's DeepSpeed facade (the DeepSpeed API on shardwise)\n"
                    "Author: shardwise\nLicense: Apache-2.0\n")
        return None

    def locate_file(self, path: str | os.PathLike) -> Path:
        return Path(__file__).parent / path


class FacadeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every ``deepspeed`` module and distribution, ahead of any installed DeepSpeed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not _is_facade_name(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin="shardwise-deepspeed-facade", is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return FacadeModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # a package: deeper paths import through this finder

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("_", "-") == ROOT:
            return [FacadeDistribution()]
        return []


def installed_finder() -> FacadeFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, FacadeFinder)), None)


def put_first() -> None:
    """Install the finder at the head of ``sys.meta_path`` (again at the head if already there)."""
    finder = installed_finder() or FacadeFinder()
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)
    sys.meta_path.insert(0, finder)
