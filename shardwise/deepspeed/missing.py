"""What the facade answers for a DeepSpeed name shardwise does not implement.

Importing such a name works (libraries import many names they never use); using it (calling it,
reading an attribute, ``isinstance``) raises :class:`DeepSpeedNameNotImplemented` naming it, with
the feature behind it when that is known (Ulysses sequence parallelism, MoE, pipelines, ...).
"""

from __future__ import annotations

from typing import Any

from shardwise.engine.ds_missing import (  # noqa: F401 - DOC and REFUSED_FEATURES handed on
    DOC,
    REFUSED_FEATURES,
    DeepSpeedEngineNameNotImplemented,
    DeepSpeedNameNotImplemented,
)


class _MissingMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "NAME" and cls.__name__.endswith("Builder"):  # an op builder's __compatible_ops__ key
            return cls.ds_name
        raise DeepSpeedNameNotImplemented(f"{cls.ds_name}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise DeepSpeedNameNotImplemented(cls.ds_name, " called")

    def __instancecheck__(cls, obj: Any) -> bool:
        raise DeepSpeedNameNotImplemented(cls.ds_name, " in isinstance()")

    def __subclasscheck__(cls, sub: Any) -> bool:
        raise DeepSpeedNameNotImplemented(cls.ds_name, " in issubclass()")


def missing_name(qualname: str) -> type:
    """A stand-in for ``qualname`` that raises, naming it, as soon as it is used."""
    return _MissingMeta(qualname.rsplit(".", 1)[-1], (), {"ds_name": qualname})


def is_missing(obj: Any) -> bool:
    return isinstance(obj, _MissingMeta)
