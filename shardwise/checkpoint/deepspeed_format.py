"""DeepSpeed ZeRO checkpoints (``global_stepN/`` of ``engine.save_checkpoint``, also the HF Trainer's).

Layout (DeepSpeed 0.19; the facts are those its ``zero_to_fp32.py`` reconstructs from):

- ``mp_rank_00_model_states.pt`` (stages 0-2) or ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (one
  per rank, stage 3): ``module`` (the module's state dict in the compute dtype; empty placeholders
  at stage 3), ``buffer_names``, ``param_shapes`` (per param group, name -> shape, in flat order),
  ``frozen_param_shapes`` / ``frozen_param_fragments`` (stage >= 2), ``shared_params``,
  ``lr_scheduler``, ``global_steps``, ``skipped_steps``, ..., and the user's ``client_state`` keys
  merged in at the top level.
- ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``, one per data-parallel rank, holding
  ``optimizer_state_dict``: ``zero_stage``, ``partition_count`` and
  * stages 1-2: ``single_partition_of_fp32_groups`` (per param group, this rank's equal slice of
    the group's flat fp32 buffer: the parameters laid end to end in ``param_shapes`` order,
    padded at the end to a multiple of 2 x world) and ``base_optimizer_state`` (the torch
    optimizer's state dict over those slices: ``exp_avg``, ``exp_avg_sq``, ``step``);
  * stage 3: ``fp32_flat_groups`` (per sub-group, this rank's partitions of each parameter, every
    parameter split into ``ceil(numel / world)`` elements per rank, the last padded) and
    ``optimizer_state_dict`` (the torch state over the same flat sub-groups).

Each parameter's full master and Adam moments are cut out of the concatenated rank slices and
handed to the one loader as full tensors (``foreign.py``). A pipeline's checkpoint (``layer_*``) is
read stage by stage through :func:`read_deepspeed` by ``deepspeed_pipeline.py``. Refused by name:
tensor-parallel layouts (``mp_rank_01`` without ``layer_*`` files), MoE expert files, fp16 dynamic loss-scaler state is
not carried over (logged), missing or extra rank files, partitions that do not add up.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.fileio import CheckpointError
from shardwise.checkpoint.foreign import Foreign, require_finite
from shardwise.checkpoint.unpickle import safe_load
from shardwise.checkpoint.validate import confined_path

log = logging.getLogger("shardwise")

DS_KEYS = frozenset({"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                     "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
                     "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
                     "checkpoint_parallel_dimensions", "sparse_tensor_module_names", "universal_checkpoint_info"})
_OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def is_deepspeed(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*model_states.pt"))


def _files(path: Path, pipeline: bool = False) -> list[str]:
    """The folder's file names, each confined to it; layouts not read refused by name (``pipeline``:
    the ``layer_*`` files and ``mp_rank`` > 0 are a pipeline's, read by ``deepspeed_pipeline.py``)."""
    names = sorted(p.name for p in path.iterdir())
    if (path / "zero").is_dir():
        raise CheckpointError(f"{path / 'zero'}: a DeepSpeed universal checkpoint (ds_to_universal); not read "
                              "(load the checkpoint it was converted from)")
    for n in names:
        confined_path(path, n, path)  # a symlink out of the folder is refused before anything is read
        if n.startswith("expp_rank_") or "_expert_" in n or (n.startswith("layer_") and not pipeline):
            what = "MoE expert" if n.startswith("expp_rank_") or "_expert_" in n else "pipeline-parallel (layer_*)"
            raise CheckpointError(f"{path / n}: a DeepSpeed {what} checkpoint file; shardwise does not read "
                                  "that layout (nothing was loaded)")
        m = _OPTIM.match(n) or _MODEL3.match(n) or re.match(r"^mp_rank_(\d+)_model_states\.pt$", n)
        if m and m.group(m.lastindex) != "00" and not pipeline:
            raise CheckpointError(f"{path / n}: a DeepSpeed tensor-parallel (mp_rank > 0) checkpoint; not read "
                                  "(nothing was loaded)")
    return names


def _ranked(path: Path, names: list[str], pattern: re.Pattern, what: str) -> tuple[list[Path], str]:
    """The rank files matching ``pattern``, ranks 0..n-1 each exactly once; and their prefix."""
    found: dict[int, str] = {}
    prefixes = set()
    for n in names:
        if m := pattern.match(n):
            found[int(m.group(2 if pattern is _OPTIM else 1))] = n
            prefixes.add(m.group(1) if pattern is _OPTIM else "")
    if len(prefixes) > 1:
        raise CheckpointError(f"{path}: {what} files with several prefixes {sorted(prefixes)}; remove the stale ones")
    if sorted(found) != list(range(len(found))):
        raise CheckpointError(f"{path}: {what} files for ranks {sorted(found)}: ranks 0..{len(found) - 1} "
                              "must all be present")
    return [path / found[r] for r in range(len(found))], (prefixes.pop() if prefixes else "")


def _get(d: Any, key: str, source: Path, kind: type | tuple = object) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise CheckpointError(f"{source}: has no {key!r}; not a DeepSpeed checkpoint file")
    if not isinstance(d[key], kind):
        raise CheckpointError(f"{source}: {key!r} is a {type(d[key]).__name__}")
    return d[key]


def _shapes(groups: Any, source: Path) -> list[dict[str, list[int]]]:
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{source}: 'param_shapes' is not a list of name -> shape maps")
    out = []
    for g in groups:
        out.append({})
        for name, shape in g.items():
            if not isinstance(name, str) or not isinstance(shape, tuple | list) or len(shape) > 8 \
                    or not all(isinstance(s, int) and 0 <= s <= 2**40 for s in shape):
                raise CheckpointError(f"{source}: param_shapes entry {name!r}: {shape!r} is not a shape")
            out[-1][name] = [int(s) for s in shape]
    return out


def _flat(tensors: Any, source: Path, what: str) -> torch.Tensor:
    if not isinstance(tensors, list) or not all(torch.is_tensor(t) and t.dim() == 1 for t in tensors):
        raise CheckpointError(f"{source}: {what} is not a list of 1-D tensors")
    return torch.cat(tensors) if tensors else torch.zeros(0)


def _optimizer(osd: dict, base_key: str, ngroups: int, source: Path) -> tuple[dict[str, list[torch.Tensor]], dict]:
    """Per state name, this rank's flat tensors by group; and the scalar ``step`` (from group 0)."""
    base = _get(osd, base_key, source, dict)
    state = _get(base, "state", source, dict)
    if set(state) != set(range(ngroups)) or not all(isinstance(s, dict) for s in state.values()):
        raise CheckpointError(f"{source}: optimizer state for groups {list(state)[:8]}, expected 0..{ngroups - 1} "
                              "(each a dict)")
    names = {k for s in state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() == 1}
    per: dict[str, list[torch.Tensor]] = {k: [] for k in sorted(names)}
    scalars: dict[str, float] = {}
    for i in range(ngroups):
        for k, v in state[i].items():
            where = f"{base_key}.state[{i}].{k}"
            if k in per:
                require_finite(v, source, where)
                per[k].append(v)
            elif (torch.is_tensor(v) and v.numel() == 1) or (isinstance(v, int | float) and not isinstance(v, bool)):
                require_finite(v, source, where)
                scalars.setdefault(k, float(v))
            else:
                raise CheckpointError(f"{source}: optimizer state {k!r} is neither per element nor a number")
        if set(state[i]) - set(scalars) != set(per):
            raise CheckpointError(f"{source}: optimizer groups hold different states")
    return per, {"scalars": scalars, "param_groups": _get(base, "param_groups", source, list)}


def fits_file(tensors: list[torch.Tensor], source: Path, what: str) -> None:
    """The tensors the reader will copy out of one file (counted each time they are referenced)
    must not claim more bytes than the file holds: a pickle may list one tensor many times, and
    ``torch.cat`` would then allocate many times the file. Checked before any copy."""
    claim = sum(t.numel() * t.element_size() for t in tensors)
    have = source.stat().st_size
    if claim > have:
        raise CheckpointError(f"{source}: its {what} claim {claim} bytes of tensor data, the file holds {have}; "
                              "refused before reading (shared or repeated tensors)")


def _counter(model: dict, key: str, source: Path) -> int:
    v = model.get(key, 0)
    if torch.is_tensor(v) and v.numel() == 1 and not v.dtype.is_floating_point and not v.dtype.is_complex:
        v = int(v.item())
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 2**62:
        raise CheckpointError(f"{source}: {key!r} is {v!r}"[:200] + "; expected a whole number of steps >= 0")
    return v


def _param_groups(groups: list, source: Path) -> list[dict]:
    out = []
    for g in groups:
        if not isinstance(g, dict) or "lr" not in g:
            raise CheckpointError(f"{source}: an optimizer param group has no 'lr'")
        out.append({k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"})
    return out


def _cut_12(shapes: list[dict], flats: list[list[torch.Tensor]], world: int, source: Path) -> list[dict]:
    """Stages 1-2: per group, the rank slices laid end to end; each parameter is a contiguous run."""
    out = []
    for gi, group in enumerate(shapes):
        have = sum(f[gi].numel() for f in flats)
        need = sum(math.prod(shape) for shape in group.values())
        if need > have or have - need >= 2 * world:  # DeepSpeed pads to a multiple of 2 x world
            raise CheckpointError(f"{source}: param group {gi} holds {have} elements over {world} ranks, "
                                  f"its parameters need {need} (param_shapes {_few(group)}); the partitions do "
                                  "not match param_shapes")
        full = torch.cat([f[gi] for f in flats])
        pos, cut = 0, {}
        for name, shape in group.items():
            n = math.prod(shape)
            cut[name] = full[pos:pos + n].view(shape)
            pos += n
        out.append(cut)
    return out


def _few(group: dict[str, list[int]]) -> str:
    items = [f"{n}: {s}" for n, s in list(group.items())[:3]]
    return "{" + ", ".join(items) + (", ..." if len(group) > 3 else "") + "}"


def _cut_3(shapes: dict[str, list[int]], flats: list[torch.Tensor], world: int, source: Path) -> dict:
    """Stage 3: every parameter is ``ceil(numel / world)`` elements of each rank's flat buffer."""
    need = sum(-(-math.prod(shape) // world) for shape in shapes.values())
    if any(f.numel() != need for f in flats):
        raise CheckpointError(f"{source}: rank partitions hold {[f.numel() for f in flats]} elements, the "
                              f"parameters of param_shapes {_few(shapes)} need {need} each")
    pos, cut = 0, {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        part = -(-n // world)
        cut[name] = torch.cat([f[pos:pos + part] for f in flats])[:n].view(shape)
        pos += part
    return cut


def _merge_states(per_rank: list[dict[str, list[torch.Tensor]]], cut, source: Path) -> dict[str, dict]:
    """Each per-element optimizer state cut like the masters: state name -> param name -> tensor."""
    names = set(per_rank[0])
    if any(set(p) != names for p in per_rank):
        raise CheckpointError(f"{source}: the rank files hold different optimizer states")
    return {k: cut([p[k] for p in per_rank]) for k in sorted(names)}


def _frozen(model: dict, model_files: list[Path], stage: int, trained: set[str], world: int) -> dict:
    """Frozen parameters, whole in their own dtype: from ``module`` (stages 0-2) or concatenated from
    every rank's ``frozen_param_fragments`` (stage 3)."""
    source = model_files[0]
    buffers = set(_get(model, "buffer_names", source, list))
    shared = set(model.get("shared_params") or {})
    module = _get(model, "module", source, dict)
    if stage < 3:
        out = {n: t for n, t in module.items() if n not in trained and n not in buffers and n not in shared}
        fits_file([t for t in out.values() if torch.is_tensor(t) and not t.is_contiguous()], source,
                  "non-contiguous frozen tensors (copied when read)")
        return out
    shapes = model.get("frozen_param_shapes") or {}
    frags = [_get(safe_load(f, f) if i else model, "frozen_param_fragments", f) or {}
             for i, f in enumerate(model_files)]
    if not isinstance(shapes, dict) or not all(isinstance(fr, dict) for fr in frags):
        raise CheckpointError(f"{source}: 'frozen_param_shapes' / 'frozen_param_fragments' are not name maps")
    for f, fr in zip(model_files, frags, strict=True):
        fits_file([fr[n] for n in shapes if torch.is_tensor(fr.get(n))], f, "frozen_param_fragments")
    out = {}
    for name, shape in _shapes([shapes], source)[0].items():
        n = math.prod(shape)
        pieces = [fr.get(name) for fr in frags]
        if any(p is None or not torch.is_tensor(p) or p.numel() != math.ceil(n / world) for p in pieces):
            raise CheckpointError(f"{source}: frozen parameter {name}: every rank must hold ceil({n}/{world}) "
                                  "of its elements in frozen_param_fragments")
        out[name] = torch.cat([p.reshape(-1) for p in pieces])[:n].view(list(shape))
    return out


def _scheduler_and_client(model: dict, source: Path) -> tuple[dict | None, dict]:
    sched = model.get("lr_scheduler")
    if sched is not None and not isinstance(sched, dict):
        raise CheckpointError(f"{source}: 'lr_scheduler' is a {type(sched).__name__}, not a state dict")
    return sched, {k: v for k, v in model.items() if k not in DS_KEYS}


def _open_optims(path: Path, names: list[str]) -> tuple[list[Path], str, list[dict], int]:
    """The optimizer rank files, their prefix, their ``optimizer_state_dict`` and the ZeRO stage."""
    files, prefix = _ranked(path, names, _OPTIM, "*_optim_states.pt")
    if not files:
        raise CheckpointError(f"{path}: no *_optim_states.pt files: a DeepSpeed checkpoint without ZeRO (stage 0) "
                              "is not read; save it at stage 1-3")
    optims = [_get(safe_load(f, f, mmap=True), "optimizer_state_dict", f, dict) for f in files]
    stage = int(_get(optims[0], "zero_stage", files[0]))
    counts = optims[0].get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    if stage not in (1, 2, 3) or any(c != len(files) for c in counts):
        raise CheckpointError(f"{files[0]}: zero_stage {stage}, partition_count {counts}: expected stage "
                              f"1-3 over the {len(files)} rank files found")
    for f, osd in zip(files, optims, strict=True):
        pads = osd.get("param_alignment_paddings") or []
        if any(x for g in pads for x in (g if isinstance(g, list) else [g])):
            raise CheckpointError(f"{f}: parameters padded inside the flat groups (param_alignment_paddings); "
                                  "not read")
    return files, prefix, optims, stage


def _model_files(path: Path, names: list[str], stage: int, world: int, mp: int = 0) -> list[Path]:
    one = [path / f"mp_rank_{mp:02d}_model_states.pt"]
    files = one if stage < 3 else _ranked(path, names, _MODEL3, "model_states")[0]
    if (stage == 3 and len(files) != world) or not files[0].is_file():
        raise CheckpointError(f"{path}: expected {'one' if stage < 3 else world} model_states file(s) for stage "
                              f"{stage} at world {world}")
    return files


def _check_rank(source: Path, key: str, flat: list, per: dict[str, list[torch.Tensor]], ngroups: int) -> None:
    """One rank file's flat masters and per-element states, before anything is copied out of them:
    one 1-D tensor per group, finite, and together no more bytes than the file holds."""
    if len(flat) != ngroups or not all(torch.is_tensor(t) and t.dim() == 1 for t in flat):
        raise CheckpointError(f"{source}: {key} is not a list of {ngroups} 1-D tensors (one per param group)")
    for gi, t in enumerate(flat):
        require_finite(t, source, f"{key}[{gi}]")
    fits_file([*flat, *(t for ts in per.values() for t in ts)], source, f"{key} and optimizer states")


def _cutter(stage: int, shapes: list[dict], world: int, path: Path):
    """``cut(per_rank)``: name -> full tensor, from each rank's flat pieces (a list per group)."""
    if stage < 3:
        return lambda per_rank: {n: t for g in _cut_12(shapes, per_rank, world, path) for n, t in g.items()}
    merged = {n: s for g in shapes for n, s in g.items()}
    return lambda per_rank: _cut_3(merged, [_flat(p, path, "a flat group") for p in per_rank], world, path)


def read_deepspeed(path: Path, mp: int | None = None, module: dict | None = None) -> Foreign:
    """The DeepSpeed checkpoint in ``path`` (a ``global_stepN`` folder) as full per-parameter tensors.

    ``mp``: read pipeline stage ``mp`` only (its ``mp_rank_MP`` files), with ``module`` (the stage's
    layers' tensors, from its ``layer_*`` files, already read and checked) as its module state."""
    names = _files(path, pipeline=mp is not None)
    if mp is not None:
        names = [n for n in names if not (m := _OPTIM.match(n)) or int(m.group(3)) == mp]
    optim_files, prefix, optims, stage = _open_optims(path, names)
    world = len(optim_files)
    model_files = _model_files(path, names, stage, world, mp or 0)
    model = safe_load(model_files[0], model_files[0], mmap=True)
    if module is not None:
        if not isinstance(model, dict) or model.get("module") is not None:
            raise CheckpointError(f"{model_files[0]}: a pipeline stage's model states must hold no 'module' (its "
                                  "layers are in the layer_* files)")
        model = {**model, "module": module}
    shapes = _shapes(_get(model, "param_shapes", model_files[0]), model_files[0])
    key, base = ("single_partition_of_fp32_groups", "base_optimizer_state") if stage < 3 else \
                ("fp32_flat_groups", "optimizer_state_dict")
    flats = [_get(osd, key, f, list) for f, osd in zip(optim_files, optims, strict=True)]
    ngroups = len(shapes) if stage < 3 else len(flats[0])
    opt = [_optimizer(osd, base, ngroups, f) for f, osd in zip(optim_files, optims, strict=True)]
    for f, flat, (per, _) in zip(optim_files, flats, opt, strict=True):
        _check_rank(f, key, flat, per, ngroups)
    cut = _cutter(stage, shapes, world, model_files[0])  # errors name the file holding param_shapes
    masters = cut(flats)
    module = _get(model, "module", model_files[0], dict)
    for n, t in masters.items():  # stages 0-2 save each parameter in the module too: shapes must agree
        if torch.is_tensor(module.get(n)) and module[n].numel() and module[n].shape != t.shape:
            raise CheckpointError(f"{model_files[0]}: param_shapes gives {n} the shape {list(t.shape)}, its module "
                                  f"tensor has {list(module[n].shape)}")
    compute = torch.bfloat16 if prefix == "bf16_" else None
    dtypes = {n: compute or (module[n].dtype if torch.is_tensor(module.get(n)) else torch.float32) for n in masters}
    if optims[0].get("dynamic_loss_scale"):
        log.warning(f"{path}: the fp16 dynamic loss scale is not carried over (the loading engine keeps its own)")
    sched, client = _scheduler_and_client(model, model_files[0])
    step, groups = opt[0][1]["scalars"], opt[0][1]["param_groups"]
    return Foreign(source=path, world=world, stage=stage,
                   trained={n: (t, dtypes[n]) for n, t in masters.items()},
                   states=_merge_states([o[0] for o in opt], cut, path),
                   scalars=dict.fromkeys(masters, step) if step else {},
                   extras=_frozen(model, model_files, stage, set(masters), world), order=list(module),
                   param_groups=_param_groups(groups, optim_files[0]), lr_scheduler=sched,
                   group_members=[list(g) for g in shapes] if len(shapes) == len(groups) else [],
                   global_steps=_counter(model, "global_steps", model_files[0]),
                   skipped_steps=_counter(model, "skipped_steps", model_files[0]),
                   client_state=client)
