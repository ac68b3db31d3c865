"""Which format a checkpoint folder is in, and its metadata and reader in shardwise's terms.

shardwise's own (``metadata.json`` + safetensors rank files), DeepSpeed's (``*_model_states.pt`` +
``*_optim_states.pt``, ``deepspeed_format.py``) and PyTorch DCP's (``.metadata`` + ``*.distcp``,
``dcp_format.py``). The foreign ones are read in full, checked, and described as shardwise
metadata over in-memory tensors (``foreign.py``), so ``load.py`` and ``hf.py`` have one path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.dcp_format import read_dcp
from shardwise.checkpoint.deepspeed_format import is_deepspeed, read_deepspeed
from shardwise.checkpoint.deepspeed_pipeline import is_pipeline, read_deepspeed_pipeline
from shardwise.checkpoint.fileio import CheckpointError, ShardReader, read_json
from shardwise.checkpoint.foreign import FOREIGN
from shardwise.checkpoint.validate import confined_path, parse_metadata


def is_dcp(path: Path) -> bool:
    return (path / ".metadata").is_file()


def is_foreign(path: Path) -> bool:
    """A DeepSpeed or DCP checkpoint folder (a folder with shardwise's metadata.json is not)."""
    return not (path / "metadata.json").exists() and (is_dcp(path) or is_deepspeed(path))


def open_checkpoint(path: Path, verify: bool = True) -> tuple[dict, ShardReader]:
    """``(metadata, reader)`` of the checkpoint in ``path``, whatever library wrote it.

    Foreign files are read completely here (every tensor unpickled without executing anything and
    checked), so an unreadable one fails before the loader starts.
    """
    if is_foreign(path):
        if is_dcp(path):
            found = read_dcp(path)
        else:  # a PipelineModule's checkpoint: layer_XX files and one model states file per stage
            found = read_deepspeed_pipeline(path) if is_pipeline(path) else read_deepspeed(path)
        return found.build()
    source = path / "metadata.json"
    meta = parse_metadata(read_json(confined_path(path, "metadata.json", source)), source)
    return meta, ShardReader(path, meta["files"], verify=verify)


def adapt_scheduler(live: dict, saved: dict, meta: dict) -> dict:
    """A foreign scheduler state in the live scheduler's shape: DeepSpeed's ``{"last_batch_iteration":
    n}`` becomes the live state with that iteration (shardwise's DeepSpeed schedulers keep both keys)."""
    if meta.get("format") == FOREIGN and set(saved) == {"last_batch_iteration"} and "last_batch_iteration" in live:
        out = dict(live)
        out["last_batch_iteration"] = out["last_epoch"] = saved["last_batch_iteration"]
        return out
    return saved


def _expected_states(opt: Any) -> set[str] | None:
    """The per-element state names a torch optimizer keeps (None: a class not known here)."""
    inner = getattr(opt, "optimizer", opt)
    groups = getattr(inner, "param_groups", [])
    if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
        return {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if any(g.get("amsgrad") for g in groups) else set())
    if isinstance(inner, torch.optim.SGD):
        return {"momentum_buffer"} if any(g.get("momentum", 0) for g in groups) else set()
    return None


def check_foreign_optimizer(engine: Any, meta: dict, source: Path) -> None:
    """A foreign optimizer state must be the loading optimizer's (SGD momentum into AdamW is refused
    by name even when the live optimizer has no state yet to compare with), and its param groups
    must hold the same parameters (hyperparameters such as weight decay are restored by position)."""
    opt = engine.optimizer
    members = meta.get("group_members") or []
    by_master = {id(g.master): g.names for g in engine.groups}
    live = [sorted(n for p in pg["params"] for n in by_master.get(id(p), [])) for pg in opt.param_groups]
    mine = {n for names in live for n in names}
    one_stage = getattr(engine, "holds_one_stage", False)  # a pipeline stage: the others' names are theirs
    if members and len(members) == len(live):
        for i, (have, saved) in enumerate(zip(live, members, strict=True)):
            if have != sorted(n for n in saved if n in mine or not one_stage):
                raise CheckpointError(f"{source}: optimizer param group {i} holds {sorted(set(saved) ^ set(have))[:4]} "
                                      "in only one of the checkpoint and this engine; build the same param groups")
    want = _expected_states(opt)
    if meta.get("format") == FOREIGN and want is not None and set(meta["states"]) != want:
        raise CheckpointError(f"{source}: the checkpoint's optimizer keeps {sorted(meta['states'])} per element, "
                              f"this engine's {type(getattr(opt, 'optimizer', opt)).__name__} keeps {sorted(want)}; "
                              "not loaded (pass load_optimizer_states=False for the weights only)")
