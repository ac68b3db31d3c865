"""DeepSpeed ``PipelineModule`` checkpoints (``global_stepN/layer_XX-model_states.pt``), read stage by stage.

Layout (DeepSpeed 0.19.8, ``PipelineModule.save_state_dict`` and the engine's ``save_checkpoint``):

- ``layer_XX-model_states.pt``: one per layer that is an ``nn.Module``, ``XX`` its *global* index in
  the ``PipelineModule``'s layer list (two digits, more past 99), holding that layer's own state dict
  (``fc.weight``, ...). In the module the layer's tensors are named ``XX.fc.weight`` (the module
  registers each layer under its index), which is also how shardwise's ``PipelineModule`` names
  them, so the index maps a file to its layer at any number of stages.
- ``mp_rank_SS_model_states.pt``: one per stage ``SS``, DeepSpeed's model states with ``module``
  ``None`` and ``param_shapes`` naming the stage's parameters (``XX.fc.weight``).
- ``[bf16_]zero_pp_rank_R_mp_rank_SS_optim_states.pt`` (ZeRO-1): stage ``SS``'s optimizer over its
  ``R`` data-parallel ranks, the same flat layout as without pipelining.

Each stage is read by ``deepspeed_format.read_deepspeed`` (its masters and Adam moments cut out of the
flat partitions), with its layers' tensors as the module; the stages are then joined into one
:class:`~shardwise.checkpoint.foreign.Foreign` that the one loader reads at any number of stages.
A layer file's tensors must be the shapes the stage's ``param_shapes`` give; a layer index outside
the stages' layers, or one no layer file holds, is refused naming the file.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from shardwise.checkpoint.deepspeed_format import fits_file, read_deepspeed
from shardwise.checkpoint.fileio import CheckpointError
from shardwise.checkpoint.foreign import Foreign
from shardwise.checkpoint.unpickle import safe_load
from shardwise.checkpoint.validate import confined_path

_LAYER = re.compile(r"^layer_(\d{2,6})-model_states\.pt$")
_STAGE = re.compile(r"^mp_rank_(\d{2,6})_model_states\.pt$")
_INDEX = re.compile(r"^(\d{1,6})\.")


def is_pipeline(path: Path) -> bool:
    return path.is_dir() and any(path.glob("layer_*-model_states.pt"))


def _stage_layers(path: Path, source: Path) -> tuple[list[int], dict[str, list[int] | None]]:
    """The global layer indices whose parameters stage file ``source`` lists (``param_shapes``), and
    the tensors its layers may hold: parameter name -> shape, buffer name -> None."""
    model = safe_load(confined_path(path, source.name, source), source, mmap=True)
    groups = model.get("param_shapes") if isinstance(model, dict) else None
    buffers = model.get("buffer_names") if isinstance(model, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or not isinstance(buffers, list):
        raise CheckpointError(f"{source}: has no 'param_shapes' / 'buffer_names' lists; not a DeepSpeed pipeline "
                              "stage's model states")
    out, allowed = set(), dict.fromkeys((b for b in buffers if isinstance(b, str)), None)
    for g in groups:
        for name, shape in g.items():
            m = _INDEX.match(name) if isinstance(name, str) else None
            if m is None:
                raise CheckpointError(f"{source}: parameter {name!r} is not named by its layer index (IDX.name); "
                                      "not a PipelineModule's checkpoint (tied layers across stages are not read)")
            out.add(int(m.group(1)))
            allowed[name] = [int(d) for d in shape] if isinstance(shape, tuple | list) else [-1]
    return sorted(out), allowed


def _check_layer(source: Path, tensors: dict[str, torch.Tensor], allowed: dict[str, list[int] | None]) -> None:
    """A layer file's tensors must be those its stage lists, at the shapes it gives."""
    for name, t in tensors.items():
        if name not in allowed:
            raise CheckpointError(f"{source}: holds {name}, which its stage's model states list neither as a "
                                  "parameter nor as a buffer (nothing was loaded)")
        if allowed[name] is not None and list(t.shape) != allowed[name]:
            raise CheckpointError(f"{source}: {name} has the shape {list(t.shape)}, its stage's param_shapes give "
                                  f"{allowed[name]} (nothing was loaded)")


def _read_layer(source: Path, index: int) -> dict[str, torch.Tensor]:
    """One layer file: a flat name -> tensor map, no more tensor bytes than the file holds."""
    sd = safe_load(source, source, mmap=True)
    if not isinstance(sd, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
        raise CheckpointError(f"{source}: not a layer's state dict (name -> tensor)")
    fits_file(list(sd.values()), source, "tensors")
    return {f"{index}.{k}": v for k, v in sd.items()}


def _stage_of(index: int, starts: list[int], end: int, source: Path) -> int:
    """The stage holding layer ``index``: the last stage whose first layer is at or before it."""
    if index > end:
        raise CheckpointError(f"{source}: layer index {index} is out of range: the stages' model states list "
                              f"layers 0..{end} (nothing was loaded)")
    return max([s for s, lo in enumerate(starts) if lo <= index] or [0])


def _modules(path: Path, names: list[str], stage_files: list[Path]) -> list[dict[str, torch.Tensor]]:
    """Per stage, its layers' tensors by module name (``XX.fc.weight``), from the layer files."""
    listed = [_stage_layers(path, f) for f in stage_files]
    starts = [ls[0] if ls else 10**7 for ls, _ in listed]
    end = max((ls[-1] for ls, _ in listed if ls), default=-1)
    modules: list[dict[str, torch.Tensor]] = [{} for _ in stage_files]
    found = set()
    for n in names:
        if m := _LAYER.match(n):
            index = int(m.group(1))
            source = confined_path(path, n, path / n)
            stage = _stage_of(index, starts, end, source)
            tensors = _read_layer(source, index)
            _check_layer(source, tensors, listed[stage][1])
            modules[stage].update(tensors)
            found.add(index)
    for f, (ls, _) in zip(stage_files, listed, strict=True):
        if lost := [i for i in ls if i not in found]:
            raise CheckpointError(f"{f}: lists parameters of layer {lost[0]}, but {path}/layer_{lost[0]:02d}-model_"
                                  "states.pt is missing (nothing was loaded)")
    return modules


def _join_groups(parts: list[Foreign]) -> tuple[list[dict], list[list[str]]]:
    """The stages' optimizer param groups as one list: group i of every stage (the same
    hyperparameters, each stage's optimizer built from the same config) holds their parameters."""
    first = parts[0].param_groups
    for p in parts[1:]:
        if p.param_groups != first:
            raise CheckpointError(f"{p.source}: the pipeline stages' optimizer param groups differ "
                                  f"({first} and {p.param_groups}); not read")
    members = [m for p in parts for m in [p.group_members]]
    if not all(len(m) == len(first) for m in members):
        return first, []
    return first, [[n for m in members for n in m[i]] for i in range(len(first))]


def _join(path: Path, parts: list[Foreign]) -> Foreign:
    out = Foreign(source=path, world=parts[0].world, stage=parts[0].stage)
    for p in parts:
        if p.world != out.world or p.stage != out.stage or set(p.states) != set(parts[0].states):
            raise CheckpointError(f"{p.source}: pipeline stages saved at different data-parallel degrees, ZeRO stages "
                                  "or optimizer states; not read")
        if dup := (set(out.trained) & set(p.trained)) | (set(out.extras) & set(p.extras)):
            raise CheckpointError(f"{p.source}: {sorted(dup)[:3]} saved by two pipeline stages")
        out.trained.update(p.trained)
        out.extras.update(p.extras)
        out.scalars.update(p.scalars)
        out.order += p.order
        for k, per in p.states.items():
            out.states.setdefault(k, {}).update(per)
    out.param_groups, out.group_members = _join_groups(parts)
    head = parts[0]
    out.lr_scheduler, out.global_steps, out.skipped_steps = head.lr_scheduler, head.global_steps, head.skipped_steps
    out.client_state = head.client_state
    return out


def read_deepspeed_pipeline(path: Path) -> Foreign:
    """The DeepSpeed pipeline checkpoint in ``path`` (a ``global_stepN`` folder), every stage's layers."""
    names = sorted(p.name for p in path.iterdir())
    stages = sorted(int(m.group(1)) for n in names if (m := _STAGE.match(n)))
    if not stages or stages != list(range(len(stages))):
        raise CheckpointError(f"{path}: pipeline model states for stages {stages}: mp_rank_00..mp_rank_"
                              f"{max(len(stages) - 1, 0):02d}_model_states.pt must all be present")
    stage_files = [path / f"mp_rank_{s:02d}_model_states.pt" for s in stages]
    modules = _modules(path, names, stage_files)
    return _join(path, [read_deepspeed(path, mp=s, module=modules[s]) for s in stages])

