"""Apply the key table (config/keys.py) to a raw config: refuse, note what is ignored, flag unknown keys.

Runs after normalization (aliases, "auto") and before pydantic validation. Keys the schema models keep
their place (pydantic checks their types); ignored or refused keys that the schema does not model are
removed, so the resolved config holds only what shardwise uses.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from pydantic import BaseModel

from shardwise.config.keys import BY_PATH, Key, children
from shardwise.config.schema import ConfigError

log = logging.getLogger("shardwise")


def suggest(key: str, options: Iterable[str]) -> str:
    """Nearest valid name (case-insensitive), or the whole list when nothing is close."""
    by_lower = {o.lower(): o for o in sorted(options)}
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"did you mean '{by_lower[close[0]]}'?" if close else "valid keys: " + ", ".join(by_lower.values())


def refusal(key: Key, value: Any) -> str:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    if key.status == "refused":
        return (f"{key.path}: DeepSpeed feature {key.note} ({key.path} = {shown}) is not implemented by "
                "shardwise; remove the key or set it to its default")
    return (f"{key.path}: the value {shown} is not implemented by shardwise ({key.note}); remove the key "
            "or use a supported value")


def _schema_fields(model: type[BaseModel] | None) -> dict[str, type[BaseModel] | None]:
    """Field name -> the section model it holds (None for scalars and free-form dicts)."""
    if model is None:
        return {}
    out: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        cands = (ann, *getattr(ann, "__args__", ()))
        out[name] = next((a for a in cands if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return out


def triage(raw: dict[str, Any], schema: type[BaseModel]) -> tuple[list[str], list[str]]:
    """Check `raw` against the key table, in place: returns (problems, notices).

    problems: one line per refused or unknown key (unknown keys get "did you mean"); those keys are
    removed so that schema validation reports only the other problems. notices: ignored keys.
    """
    problems: list[str] = []
    notices: list[str] = []
    _walk(raw, "", schema, raw, problems, notices)
    return problems, notices


def raise_problems(lines: list[str]) -> None:
    """One ConfigError for all problems found (one line each)."""
    if len(lines) == 1:
        raise ConfigError(lines[0])
    if lines:
        raise ConfigError(f"{len(lines)} problems in the config:\n  " + "\n  ".join(lines))


def _walk(section: dict[str, Any], path: str, model: type[BaseModel] | None, root: dict[str, Any],
          problems: list[str], notices: list[str]) -> None:
    known = children(path)
    fields = _schema_fields(model)
    for name in list(section):
        value = section[name]
        shown = name if isinstance(name, str) and name.isprintable() else repr(name)  # one line per problem
        full = f"{path}.{shown}" if path else shown
        key = known.get(name) if isinstance(name, str) else None
        if key is None:
            if model is not None and name in fields:
                continue  # a schema field the table does not list (pydantic checks it)
            top = path and isinstance(name, str) and name in children("")  # e.g. "aio" (HF's docs print it so)
            hint = (f"'{name}' is a top-level section, not under '{path}': move it out (DeepSpeed refuses it "
                    "there too)") if top else suggest(str(name), set(known) | set(fields))
            problems.append(f"{full}: unknown key; {hint}")
            del section[name]
            continue
        if key.accepts is not None and not _accepted(key, value, root):
            problems.append(refusal(key, value))
            del section[name]
            continue
        if key.status == "ignored" and value not in (None, False, {}, []):
            notices.append(f"config key '{full}' is accepted and ignored by shardwise: {key.note}")
        if key.status != "honoured" and name not in fields:
            del section[name]
        elif isinstance(value, dict) and not key.subtree and children(full):
            _walk(value, full, fields.get(name), root, problems, notices)


def _accepted(key: Key, value: Any, root: dict[str, Any]) -> bool:
    try:
        return bool(key.accepts(value, root))
    except (TypeError, ValueError, AttributeError):
        return False


def announce(notices: list[str]) -> None:
    """One INFO line per ignored key, on rank 0 only."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    for line in dict.fromkeys(notices):
        log.info(line)


def check_table_covers_schema(schema: type[BaseModel], path: str = "") -> list[str]:
    """Schema fields that the key table does not classify (a test keeps this empty)."""
    missing = []
    for name, sub in _schema_fields(schema).items():
        shown = name if isinstance(name, str) and name.isprintable() else repr(name)  # one line per problem
        full = f"{path}.{shown}" if path else shown
        if full not in BY_PATH:
            missing.append(full)
        elif sub is not None and not BY_PATH[full].subtree:
            missing += check_table_covers_schema(sub, full)
    return missing
