"""Read a config file or dict as DeepSpeed does (JSON or hjson), refusing what DeepSpeed refuses.

DeepSpeed reads config files with hjson (JSON with comments, unquoted keys and strings) and rejects
duplicate keys. Hostile input must give one clear ConfigError, never RecursionError, OverflowError or
MemoryError: nesting is bounded, and the parser's own failures are rewritten with the file name.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import hjson

from shardwise.config.schema import ConfigError, check_timeout

MAX_DEPTH = 32  # a DeepSpeed config is at most 5 levels deep; anything far deeper is not a config
MAX_BYTES = 16 * 1024 * 1024


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def _depth_ok(data: Any) -> bool:
    """Iterative (no recursion): is every container nested at most MAX_DEPTH deep?"""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > MAX_DEPTH:
                return False
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return True


def _parse(text: str, where: str) -> Any:
    """JSON first (exact error positions), then hjson (DeepSpeed's format)."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        raise ConfigError(f"{where}: duplicate key '{exc}' (DeepSpeed rejects duplicate keys); keep "
                          "only one") from None
    except json.JSONDecodeError as exc:
        json_error = f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a config (more than {MAX_DEPTH} levels)") from None
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        raise ConfigError(f"{where}: duplicate key '{exc}' (DeepSpeed rejects duplicate keys); keep "
                          "only one") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a config (more than {MAX_DEPTH} levels)") from None
    except (ValueError, OverflowError, TypeError, IndexError) as exc:  # hjson's own failures
        raise ConfigError(f"{where} is not valid JSON ({json_error}) nor hjson "
                          f"({str(exc).splitlines()[0][:120]})") from None


def read_config(config: str | os.PathLike[str] | dict[str, Any] | None) -> dict[str, Any]:
    """The raw config as a new dict (the caller's dict is never modified)."""
    if config is None:
        return {}
    if isinstance(config, dict):
        if not _depth_ok(config):
            raise ConfigError(f"config dict: nested too deeply to be a config (more than {MAX_DEPTH} levels)")
        return copy.deepcopy(config)
    if not isinstance(config, str | os.PathLike):
        raise ConfigError(f"config must be a path to a JSON file or a dict, not {type(config).__name__}")
    path = Path(config)
    where = f"config file '{path}'"
    if not path.is_file():
        raise ConfigError(f"{where} does not exist; pass the path of a DeepSpeed JSON config")
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ConfigError(f"{where} is larger than {MAX_BYTES // 2**20} MiB; a config is a few KiB")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where} cannot be read: {exc}") from None
    data = _parse(text, where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a JSON object, not {type(data).__name__}")
    if not _depth_ok(data):
        raise ConfigError(f"{where}: nested too deeply to be a config (more than {MAX_DEPTH} levels)")
    return _plain(data)


def _plain(data: Any) -> Any:
    """hjson's OrderedDicts as plain dicts (depth already bounded)."""
    if isinstance(data, dict):
        return {k: _plain(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_plain(v) for v in data]
    return data


def timeout_of(config: str | os.PathLike[str] | dict[str, Any] | None) -> float | None:
    """`shardwise.timeout_s` of a config (None when absent), checked, for init_distributed(timeout=).

    initialize() calls this before joining the job, since the full load needs the world size.
    """
    raw = read_config(config)
    section = raw.get("shardwise")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"shardwise: must be an object such as {{\"timeout_s\": 600}}, not {section!r}")
    try:
        return check_timeout(section.get("timeout_s"))
    except ValueError as exc:
        raise ConfigError(f"shardwise.timeout_s: {exc}") from None
