"""Resolve ``deepspeed.<path>`` imports to proxies over shardwise modules (see ``__init__``)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

# DeepSpeed module path -> the shardwise modules that hold its public names, searched in order.
SOURCES: dict[str, list[str]] = {
    "deepspeed": ["shardwise"],
    "deepspeed.comm": ["shardwise.comm"],
    "deepspeed.utils": ["shardwise.utils"],
    "deepspeed.zero": ["shardwise.zero"],
    "deepspeed.runtime.zero": ["shardwise.zero"],
    "deepspeed.runtime.zero.partition_parameters": ["shardwise.zero"],
    "deepspeed.utils.zero_to_fp32": ["shardwise.utils.zero_to_fp32"],
    "deepspeed.moe.utils": ["shardwise.utils.moe"],
    "deepspeed.checkpoint.utils": ["shardwise.utils.checkpoint_utils"],
    "deepspeed.runtime.lr_schedules": ["shardwise.optim", "deepspeed._harness"],  # WarmupLR & co.
    "deepspeed.runtime.config": ["deepspeed._harness"],  # only its config-string constants
    "deepspeed.utils.torch": ["deepspeed._harness"],
    "deepspeed.git_version_info": ["deepspeed._harness"],
    "deepspeed.runtime.swap_tensor": ["deepspeed._harness"],  # only a size constant
    "deepspeed.runtime.zero.offload_config": ["deepspeed._harness"],
}
# Real files of the shim itself (not proxied).
OWN = {"deepspeed.accelerator", "deepspeed._proxy", "deepspeed._harness"}


class ShimMissing(Exception):
    """A DeepSpeed name with no shardwise counterpart was used (the report classifies it)."""


class _StubMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "NAME":  # an op builder's key into __compatible_ops__ (always False here)
            return cls._ds_name
        raise ShimMissing(f"SHIM-MISSING {cls._ds_name}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise ShimMissing(f"SHIM-MISSING {cls._ds_name}")

    def __instancecheck__(cls, obj: Any) -> bool:
        raise ShimMissing(f"SHIM-MISSING {cls._ds_name} (isinstance)")


def _stub(qualname: str) -> type:
    return _StubMeta(qualname.rsplit(".", 1)[-1], (), {"_ds_name": qualname})


# Op builders whose job shardwise does with torch (Adam/AdamW on the host for offload, and on the
# accelerator): tests gated on them run; every other DeepSpeed kernel counts as absent.
_TORCH_DOES = ("CPUAdamBuilder", "FusedAdamBuilder")


class _NoOps(dict):
    """``deepspeed.ops.__compatible_ops__``: shardwise builds none of DeepSpeed's C++/CUDA ops."""

    def __missing__(self, key: str) -> bool:
        return key.endswith(_TORCH_DOES)


class ProxyModule(types.ModuleType):
    def __init__(self, name: str, sources: list[str]):
        super().__init__(name)
        self.__path__ = []  # a package, so deeper paths import
        self._sources = sources

    def __getattr__(self, name: str) -> Any:
        if name == "__compatible_ops__":
            return _NoOps()
        if name.startswith("__") or name == "_sources":
            raise AttributeError(name)
        for src in self._sources:
            mod = importlib.import_module(src)
            if hasattr(mod, name):
                return getattr(mod, name)
        sub = f"{self.__name__}.{name}"
        if sub in sys.modules:
            return sys.modules[sub]
        return _stub(sub)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith("deepspeed.") or fullname.split(".")[:2] == ["deepspeed", "accelerator"]:
            return None
        if fullname in OWN:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        return ProxyModule(spec.name, SOURCES.get(spec.name, []))

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Put the finder first and make the ``deepspeed`` package itself fall back to stubs."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    pkg = sys.modules["deepspeed"]

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():  # a class or constant DeepSpeed has at top level, not a submodule
            return _stub(f"deepspeed.{name}")
        try:
            return importlib.import_module(f"deepspeed.{name}")
        except ImportError:
            return _stub(f"deepspeed.{name}")

    pkg.__getattr__ = missing
