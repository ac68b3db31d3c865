"""Top-level keys in dotted form (``"zero_optimization.reduce_bucket_size": 4096``), as client
libraries write them.

TRL's ``prepare_deepspeed`` (copied from an older Accelerate) adds three such keys to the config
it passes to ``deepspeed.initialize`` for a reference or reward model. DeepSpeed 0.19 reads every
setting by its nested name (``param_dict["zero_optimization"]``, then the field inside) and never
looks at a dotted top-level key: it ignores it silently, like any unknown top-level key.

shardwise does what DeepSpeed does where that is harmless and refuses where it is not:

* a dotted key naming a real key whose value cannot change the numbers (a key the table already
  ignores, or a performance knob such as a bucket size) is dropped with one warning, so the run
  is the one DeepSpeed makes;
* one whose value equals what the nested config already gives is dropped the same way;
* any other (``"bf16.enabled": true`` next to no ``bf16`` section) would make DeepSpeed train
  with a setting the user did not ask for: refused, naming the key and its nested spelling;
* a dotted key naming no real key stays in the config and is refused as an unknown key.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from pydantic import BaseModel

from shardwise.config.keys import BY_PATH, Key
from shardwise.config.schema import ConfigError

log = logging.getLogger("shardwise")


def _zero(cfg: Any) -> Any:
    return cfg.zero_optimization


# Honoured keys that are performance knobs: what shardwise computes does not depend on them, except
# under the named condition (block-quantized collectives cut their 256-element blocks inside the
# buckets / persistent groups these keys shape).
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "zero_optimization.reduce_bucket_size": lambda cfg: not _zero(cfg).zero_quantized_gradients,
    "zero_optimization.allgather_bucket_size": lambda cfg: True,
    "zero_optimization.stage3_prefetch_bucket_size": lambda cfg: True,
    "zero_optimization.stage3_max_live_parameters": lambda cfg: True,
    "zero_optimization.stage3_param_persistence_threshold": lambda cfg: not _zero(cfg).zero_quantized_weights,
}
# Logging and profiling sections: what they write never feeds back into training, so a dotted copy
# DeepSpeed would ignore is dropped like a performance knob (the nested section still decides the logs).
LOGGING_ONLY = ("tensorboard.", "csv_monitor.", "wandb.", "comet.", "comms_logger.", "flops_profiler.")

_MISSING = object()


def key_for(path: str) -> Key | None:
    """The key-table row a dotted path names: its own row, or a ``subtree`` section above it."""
    if path in BY_PATH:
        return BY_PATH[path]
    parts = path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        row = BY_PATH.get(".".join(parts[:n]))
        if row is not None:
            return row if row.subtree else None
    return None


def take_dotted(raw: dict[str, Any]) -> dict[str, Any]:
    """Remove from ``raw`` (in place) the top-level dotted keys that name a real key; return them.

    Dotted keys that name nothing stay, for the unknown-key check to refuse with a suggestion.
    """
    found = {k: raw[k] for k in list(raw) if isinstance(k, str) and "." in k and key_for(k) is not None}
    for k in found:
        del raw[k]
    return found


def _effective(cfg: BaseModel, path: str) -> Any:
    """The value the loaded config holds at ``path`` (pydantic sections, then plain dicts)."""
    node: Any = cfg
    for part in path.split("."):
        if isinstance(node, BaseModel) and part in type(node).model_fields:
            node = getattr(node, part)
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return _MISSING
    return node


def _harmless(path: str, value: Any, cfg: BaseModel) -> bool:
    row = key_for(path)
    if row is not None and row.status == "ignored":
        return True
    if path in NEUTRAL and NEUTRAL[path](cfg):
        return True
    if path.startswith(LOGGING_ONLY):
        return True
    have = _effective(cfg, path)
    return have is not _MISSING and not isinstance(have, BaseModel) and have == value


def settle_dotted(dotted: dict[str, Any], cfg: BaseModel) -> list[str]:
    """Check the dotted keys against the loaded config: refuse those that would change training,
    return the others (dropped, as DeepSpeed drops them) for the one warning."""
    refused = [k for k, v in dotted.items() if not _harmless(k, v, cfg)]
    lines = []
    for k in refused:
        have = _effective(cfg, k)
        now = "" if have is _MISSING or isinstance(have, BaseModel) else f" (the config gives {have!r})"
        lines.append(f"{k}: a dotted key at the top level, which DeepSpeed ignores; its value {dotted[k]!r} would "
                     f"change training{now}, so shardwise will not ignore it: write it nested "
                     f"({_nested(k, dotted[k])}) or remove it")
    if lines:
        raise ConfigError(lines[0] if len(lines) == 1 else
                          f"{len(lines)} problems in the config:\n  " + "\n  ".join(lines))
    return sorted(dotted)


def _nested(path: str, value: Any) -> str:
    parts = path.split(".")
    return "".join(f'{{"{p}": ' for p in parts) + json.dumps(value, default=str) + "}" * len(parts)


def warn_dotted(ignored: list[str]) -> None:
    """One warning for every dotted key dropped, on rank 0 only."""
    if not ignored or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    log.warning("config: top-level dotted key(s) %s ignored, as DeepSpeed ignores them (they do not change "
                "the numbers); write a key nested to have it applied", ", ".join(ignored))
