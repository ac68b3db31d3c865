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

Tied layers (``TiedLayerSpec``): DeepSpeed registers a tied module once per stage holding a use, as
``tied_modules.KEY``, so every such stage lists ``tied_modules.KEY.NAME`` in its ``param_shapes`` and
steps its own copy in its optimizer (on the gradient all-reduced over the tied stages, so the copies
stay equal). ``save_state_dict`` writes one file per layer that is a module: a use of the key without
``forward_fn`` is the module itself and is written as ``layer_IDX-model_states.pt`` holding ``NAME``
(no ``tied_modules.KEY.`` prefix), a use through ``forward_fn`` is a ``functools.partial`` and has no
file. A layer file whose tensors are not its index's (``IDX.NAME`` listed by no stage) is read as the
one tied key whose listed tensors it holds, all of them at the listed shapes; the stages' copies are
joined into one tensor (``tied_modules.KEY.NAME``, the name shardwise's ``PipelineModule`` uses too),
refused when two stages' masters or optimizer states, or two layer files, differ in any bit. A key
listed by a stage that no layer file holds (a missing file; or a key every use of which has a
``forward_fn``) is refused, naming the stage's file.
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
OPTIM_FILE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_TIED = re.compile(r"^tied_modules\.([^.]+)\.(.+)$")


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
            if m is None and not (isinstance(name, str) and _TIED.match(name)):
                raise CheckpointError(f"{source}: parameter {name!r} is named neither by its layer index (IDX.name) "
                                      "nor as a tied module's (tied_modules.KEY.name); not a PipelineModule's "
                                      "checkpoint")
            if m is not None:
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


def _read_layer(source: Path) -> dict[str, torch.Tensor]:
    """One layer file: its own tensor names -> tensor, no more tensor bytes than the file holds."""
    sd = safe_load(source, source, mmap=True)
    if not isinstance(sd, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
        raise CheckpointError(f"{source}: not a layer's state dict (name -> tensor)")
    fits_file(list(sd.values()), source, "tensors")
    return dict(sd)


def _stage_of(index: int, starts: list[int], end: int, source: Path) -> int:
    """The stage holding layer ``index``: the last stage whose first layer is at or before it."""
    if index > end:
        raise CheckpointError(f"{source}: layer index {index} is out of range: the stages' model states list "
                              f"layers 0..{end} (nothing was loaded)")
    return max([s for s, lo in enumerate(starts) if lo <= index] or [0])


def _tied_listed(listed: list[tuple[list[int], dict]]) -> dict[str, dict[str, list[int] | None]]:
    """Per tied key, what the stages list of it: NAME -> shape (None: a buffer)."""
    out: dict[str, dict[str, list[int] | None]] = {}
    for _, allowed in listed:
        for name, shape in allowed.items():
            if m := _TIED.match(name):
                out.setdefault(m.group(1), {})[m.group(2)] = shape
    return out


def _as_tied(source: Path, raw: dict[str, torch.Tensor], tied: dict[str, dict]) -> dict[str, torch.Tensor] | None:
    """A layer file read as the one tied module whose listed tensors it holds (by module name,
    ``tied_modules.KEY.NAME``), all of them at the listed shapes; None when no tied key lists its names."""
    named = [k for k, names in tied.items() if raw and all(n in names for n in raw)]
    fits = [k for k in named if all(tied[k][n] is None or list(t.shape) == tied[k][n] for n, t in raw.items())]
    if named and not fits:
        n = next(n for n, t in raw.items() if tied[named[0]][n] not in (None, list(t.shape)))
        raise CheckpointError(f"{source}: tied_modules.{named[0]}.{n} has the shape {list(raw[n].shape)}, the stages' "
                              f"param_shapes give {tied[named[0]][n]} (nothing was loaded)")
    if len(fits) > 1:
        raise CheckpointError(f"{source}: its tensors {sorted(raw)} fit the tied layers {fits} alike; which one it "
                              "holds cannot be told (nothing was loaded)")
    if not fits:
        return None
    if lost := sorted(n for n, shape in tied[fits[0]].items() if shape is not None and n not in raw):
        raise CheckpointError(f"{source}: holds tied layer {fits[0]!r} without its {lost[0]} (listed in the stages' "
                              "param_shapes); not a whole tied module (nothing was loaded)")
    return {f"tied_modules.{fits[0]}.{n}": t for n, t in raw.items()}


def _add_tied(source: Path, mapped: dict[str, torch.Tensor], seen: dict[str, tuple[Path, torch.Tensor]],
              modules: list[dict[str, torch.Tensor]], listed: list[tuple[list[int], dict]]) -> None:
    """A tied layer file's tensors into every stage listing them; a second file with other bits is refused."""
    for name, t in mapped.items():
        if name in seen and not torch.equal(seen[name][1], t):
            raise CheckpointError(f"{source}: holds {name} with other values than {seen[name][0].name} (a tied "
                                  "layer's files must agree; nothing was loaded)")
        seen.setdefault(name, (source, t))
        for stage, (_, allowed) in enumerate(listed):
            if name in allowed:
                modules[stage][name] = t


def _modules(path: Path, names: list[str], stage_files: list[Path]) -> list[dict[str, torch.Tensor]]:
    """Per stage, its layers' tensors by module name (``XX.fc.weight``, ``tied_modules.KEY.weight``)."""
    listed = [_stage_layers(path, f) for f in stage_files]
    starts = [ls[0] if ls else 10**7 for ls, _ in listed]
    end = max((ls[-1] for ls, _ in listed if ls), default=-1)
    tied = _tied_listed(listed)
    modules: list[dict[str, torch.Tensor]] = [{} for _ in stage_files]
    found, seen = set(), {}
    for n in names:
        if m := _LAYER.match(n):
            index = int(m.group(1))
            source = confined_path(path, n, path / n)
            raw = _read_layer(source)
            mapped = None if any(f"{index}.{k}" in a for _, a in listed for k in raw) else _as_tied(source, raw, tied)
            if mapped is not None:
                _add_tied(source, mapped, seen, modules, listed)
                continue
            if not raw and index > end:  # a module without tensors (DeepSpeed writes its empty file too)
                continue
            stage = _stage_of(index, starts, end, source)
            tensors = {f"{index}.{k}": v for k, v in raw.items()}
            _check_layer(source, tensors, listed[stage][1])
            modules[stage].update(tensors)
            found.add(index)
    for f, (ls, allowed) in zip(stage_files, listed, strict=True):
        if lost := [i for i in ls if i not in found]:
            raise CheckpointError(f"{f}: lists parameters of layer {lost[0]}, but {path}/layer_{lost[0]:02d}-model_"
                                  "states.pt is missing (nothing was loaded)")
        if lost := sorted(n for n, shape in allowed.items() if _TIED.match(n) and shape is not None and n not in seen):
            raise CheckpointError(f"{f}: lists the tied {lost[0]}, but no layer_*-model_states.pt holds it (a "
                                  "missing file; DeepSpeed writes a tied module with its use that has no forward_fn); "
                                  "nothing was loaded")
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
    return first, [list(dict.fromkeys(n for m in members for n in m[i])) for i in range(len(first))]  # tied: once


def _same(a: object, b: object) -> bool:
    """Bit for bit: tensors by ``torch.equal`` (dtype and shape too), anything else by ``==``."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _merge(out: Foreign, p: Foreign, source: Path) -> None:
    """Stage ``p`` into ``out``: a name both hold must be a tied module's (``tied_modules.KEY.``), its
    master, per-element states and step equal bit for bit (DeepSpeed steps every copy alike)."""
    for name in (set(out.trained) & set(p.trained)) | (set(out.extras) & set(p.extras)):
        if not _TIED.match(name):
            raise CheckpointError(f"{source}: {name} saved by two pipeline stages (nothing was loaded)")
        pairs = [(out.trained.get(name), p.trained.get(name)), (out.extras.get(name), p.extras.get(name)),
                 (out.scalars.get(name), p.scalars.get(name)),
                 *((out.states.get(k, {}).get(name), per.get(name)) for k, per in p.states.items())]
        if not all(_same(a, b) for a, b in pairs):
            raise CheckpointError(f"{source}: the tied {name} differs from an earlier stage's copy (its weight or "
                                  "optimizer state); DeepSpeed keeps a tied weight's copies equal (nothing was "
                                  "loaded)")
    out.trained.update(p.trained)
    out.extras.update(p.extras)
    out.scalars.update(p.scalars)
    out.order += [n for n in p.order if n not in out.order]
    for k, per in p.states.items():
        out.states.setdefault(k, {}).update(per)


def _join(path: Path, parts: list[Foreign], optim_files: list[Path]) -> Foreign:
    out = Foreign(source=path, world=parts[0].world, stage=parts[0].stage)
    for p, source in zip(parts, optim_files, strict=True):
        if p.world != out.world or p.stage != out.stage or set(p.states) != set(parts[0].states):
            raise CheckpointError(f"{p.source}: pipeline stages saved at different data-parallel degrees, ZeRO stages "
                                  "or optimizer states; not read")
        _merge(out, p, source)
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
    parts = [read_deepspeed(path, mp=s, module=modules[s]) for s in stages]
    optim = [path / next((n for n in names if (m := OPTIM_FILE.match(n)) and int(m.group(3)) == s),
                         f"zero_pp_rank_0_mp_rank_{s:02d}_optim_states.pt") for s in stages]
    return _join(path, parts, optim)
