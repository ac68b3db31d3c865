"""Checkpoint section for the state of optimizers that step whole tensors (``zero/whole_tensor.py``).

A non-elementwise optimizer (Adafactor, Muon, LAMB, a user's own) keeps state per *parameter*, in
whatever shapes it chose (Adafactor's ``[rows, 1]`` / ``[1, cols]`` factors, Muon's momentum), so
the flat format's element ranges do not apply. Each rank writes the state of the tensors it owns,
whole, into its own rank file as ``whole/STATE/NAME``; 0-dim tensors and Python numbers (``step``)
go to JSON as the flat format's scalars. ``metadata.json`` gets the section ``whole_tensor_state``:
``{"optimizer": class name, "tensors": {NAME: {"shape", "group", "file", "states": {STATE: {"shape",
"dtype"}}, "scalars": {STATE: {"value", "dtype"}}}}}``. Ownership depends on the world size, so a
loading rank finds the tensors it owns now by name, in whichever file holds them.

Whole-tensor and flat state are different layouts of different optimizer classes (the class fixes
the mode): loading one into the other is refused by name. Only a side with no saved optimizer
state at all converts, trivially.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shardwise.checkpoint.fileio import CheckpointError, ShardReader, dtype_from_name, dtype_name
from shardwise.checkpoint.validate import ANY_DTYPES, Name, Scalar, Shape
from shardwise.zero.whole_tensor import WholeTensorStepper, whole_tensor_of

if TYPE_CHECKING:
    from shardwise.checkpoint.target import CheckpointTarget

SECTION = "whole_tensor_state"
PREFIX = "whole"
StateKey = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^/]+$")]


# -- save ---------------------------------------------------------------------------------------
def owned_by_name(stepper: WholeTensorStepper) -> dict[str, torch.Tensor]:
    """This rank's whole tensors (what its optimizer steps), by parameter name."""
    return {o.group.names[o.index]: o.tensor for owned in stepper.owned.values() for o in owned}


def _group_of(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    return {id(p): i for i, pg in enumerate(optimizer.param_groups) for p in pg["params"]}


def split_whole_state(name: str, state: dict) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """One tensor's state: tensors for the file (any shape but 0-dim), scalars for the JSON."""
    tensors, scalars = {}, {}
    for k, v in state.items():
        if not isinstance(k, str) or "/" in k or not k:
            raise TypeError(f"optimizer state key {k!r} of {name} is not a plain string; the checkpoint "
                            "format keys state by name")
        if torch.is_tensor(v) and v.dim() == 0:
            scalars[k] = {"value": v.item(), "dtype": dtype_name(v.dtype)}
        elif torch.is_tensor(v):
            tensors[k] = v
        elif isinstance(v, bool | int | float):
            scalars[k] = {"value": v, "dtype": None}
        else:
            raise TypeError(f"optimizer state {k!r} of {name} is a {type(v).__name__}: checkpoints hold "
                            "tensors and numbers only (no pickle)")
    return tensors, scalars


def whole_state_pieces(engine: CheckpointTarget, writes: bool) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """The file pieces and the manifest entries (``file`` filled in by the caller) of this rank's
    owned tensors; nothing when the optimizer is flat or this rank does not write (stage 0, rank > 0)."""
    stepper = whole_tensor_of(engine.optimizer)
    if stepper is None or not writes:
        return [], {}
    opt = engine.optimizer
    group = _group_of(opt)
    pieces, entries = [], {}
    for name, t in owned_by_name(stepper).items():
        tensors, scalars = split_whole_state(name, opt.state.get(t, {}))
        entries[name] = {"shape": list(t.shape), "group": group[id(t)], "file": None, "scalars": scalars,
                         "states": {k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)}
                                    for k, v in tensors.items()}}
        pieces += [(f"{PREFIX}/{k}/{name}", v.detach()) for k, v in tensors.items()]
    return pieces, entries


def whole_optimizer_name(engine: CheckpointTarget) -> str | None:
    """The optimizer's class name when it keeps non-elementwise state, else None (read at the save
    call: the metadata is written later, maybe after training went on, :mod:`checkpoint.publish`)."""
    return None if whole_tensor_of(engine.optimizer) is None else type(engine.optimizer).__name__


def merge_whole_state(optimizer_name: str | None, manifests: list[dict]) -> dict | None:
    """The metadata section from every rank's manifest (None for a flat optimizer)."""
    if optimizer_name is None:
        return None
    tensors: dict[str, dict] = {}
    for m in manifests:
        for name, e in m.get(SECTION, {}).items():
            tensors[name] = {**e, "file": m["file"]}
    return {"optimizer": optimizer_name, "tensors": tensors}


# -- schema -------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _StateInfo(_Strict):
    shape: Shape
    dtype: Annotated[str, Field(pattern="^(" + "|".join(ANY_DTYPES) + ")$")]


class _TensorState(_Strict):
    shape: Shape
    group: Annotated[int, Field(ge=0, le=4096)]
    file: Name | None
    states: dict[StateKey, _StateInfo]
    scalars: dict[StateKey, Scalar]

    @model_validator(mode="after")
    def _has_file(self) -> _TensorState:
        if self.states and self.file is None:
            raise ValueError("state tensors without a file")
        if set(self.states) & set(self.scalars):
            raise ValueError(f"{sorted(set(self.states) & set(self.scalars))} both tensor and scalar state")
        return self


class _Section(_Strict):
    optimizer: Name
    tensors: dict[Name, _TensorState]


def parse_section(meta: dict, source: Path) -> dict:
    """The validated section: its files listed in ``files``, its names saved as trained tensors."""
    try:
        sec = _Section.model_validate(meta[SECTION]).model_dump()
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise CheckpointError(f"{source}: invalid {SECTION}: {where}: {err['msg']}") from None
    for name, e in sec["tensors"].items():
        if name not in meta["tensors"]:
            raise CheckpointError(f"{source}: {SECTION} holds {name!r}, which is not a saved trained tensor")
        if e["states"] and e["file"] not in meta["files"]:
            raise CheckpointError(f"{source}: {SECTION}[{name!r}] names file {e['file']!r}, not listed in 'files'")
    return sec


# -- load ---------------------------------------------------------------------------------------
def check_state_layout(engine: CheckpointTarget, meta: dict, source: Path) -> None:
    """Refuse whole-tensor optimizer state for a flat optimizer and the reverse, naming both."""
    live_whole = whole_tensor_of(engine.optimizer) is not None
    sec = parse_section(meta, source) if meta.get(SECTION) is not None else None
    saved_whole = sec is not None and any(e["states"] or e["scalars"] for e in sec["tensors"].values())
    saved_flat = bool(meta["states"]) or any(meta["scalars"].values())
    name = type(engine.optimizer).__name__
    if live_whole and saved_flat:
        raise CheckpointError(f"{source}: holds flat-shard optimizer state {sorted(meta['states'])} (an elementwise "
                              f"optimizer's), but this {name} steps whole tensors (docs/optimizers.md): "
                              "different state layouts; load with load_optimizer_states=False")
    if not live_whole and saved_whole:
        raise CheckpointError(f"{source}: {SECTION} holds the whole-tensor state of a {sec['optimizer']}, but this "
                              f"{name} is elementwise and steps flat shards: different state layouts; load "
                              "with load_optimizer_states=False")
    if live_whole and saved_whole and sec["optimizer"] != name:
        raise CheckpointError(f"{source}: {SECTION} was saved by {sec['optimizer']}, this optimizer is {name}")


def _check_against_live(name: str, entry: dict, live: dict, source: Path) -> None:
    """Saved state keys, shapes and dtypes must be the live optimizer's (when it already has state)."""
    if not live:
        return
    keys = set(entry["states"]) | set(entry["scalars"])
    if keys != set(live):
        raise CheckpointError(f"{source}: {SECTION}[{name!r}] has state {sorted(keys)}, this optimizer keeps "
                              f"{sorted(live)}")
    for k, info in entry["states"].items():
        v = live[k]
        if not torch.is_tensor(v) or list(v.shape) != info["shape"] or dtype_name(v.dtype) != info["dtype"]:
            have = f"{dtype_name(v.dtype)} {list(v.shape)}" if torch.is_tensor(v) else type(v).__name__
            raise CheckpointError(f"{source}: {SECTION}[{name!r}].states[{k!r}] is {info['dtype']} {info['shape']}, "
                                  f"this optimizer keeps {have}")


def _scalar(sc: dict) -> Any:
    return sc["value"] if sc["dtype"] is None else torch.tensor(sc["value"], dtype=dtype_from_name(sc["dtype"]))


def stage_whole_state(engine: CheckpointTarget, meta: dict, reader: ShardReader, staged: dict, source: Path,
                      skip: set[str]) -> None:
    """Fill ``staged["state"]`` (a torch state_dict's) with the saved state of every tensor this rank
    owns now, read by name; all of them must be there (names in ``skip``, absent under
    ``load_module_strict=False``, keep their current state)."""
    stepper = whole_tensor_of(engine.optimizer)
    if stepper is None:
        return
    if meta.get(SECTION) is None:
        if meta["tensors"] and any(n not in skip for n in owned_by_name(stepper)):
            raise CheckpointError(f"{source}: has no {SECTION} section (saved by a flat-shard optimizer, or "
                                  "without optimizer state): load with load_optimizer_states=False")
        return
    sec = parse_section(meta, source)
    opt = engine.optimizer
    group = _group_of(opt)
    index = {id(p): i for pg_live, pg_sd in zip(opt.param_groups, opt.state_dict()["param_groups"], strict=True)
             for p, i in zip(pg_live["params"], pg_sd["params"], strict=True)}
    for name, t in owned_by_name(stepper).items():
        if name in skip:
            continue
        entry = sec["tensors"].get(name)
        if entry is None:
            raise CheckpointError(f"{source}: {SECTION} has no state for {name!r} (saved by {sec['optimizer']} "
                                  f"for {len(sec['tensors'])} tensors)")
        if entry["shape"] != list(t.shape) or entry["group"] != group[id(t)]:
            raise CheckpointError(f"{source}: {SECTION}[{name!r}] is for shape {entry['shape']} in param group "
                                  f"{entry['group']}, here it is {list(t.shape)} in group {group[id(t)]}")
        _check_against_live(name, entry, opt.state.get(t, {}), source)
        st = {k: _scalar(sc) for k, sc in entry["scalars"].items()}
        for k, info in entry["states"].items():
            st[k] = reader.read_full(f"{PREFIX}/{k}/{name}", entry["file"], dtype_from_name(info["dtype"]),
                                     info["shape"])
        if st:
            staged["state"][index[id(t)]] = st
    reader.release()
