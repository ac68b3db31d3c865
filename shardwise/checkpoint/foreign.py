"""A checkpoint written by another library, described in shardwise's own terms.

A foreign reader (``deepspeed_format.py``, ``dcp_format.py``) turns the files into full
per-parameter tensors: fp32 masters, each per-element optimizer state, frozen parameters and
buffers, plus the JSON state (param groups, scheduler, counters, client state). :class:`Foreign`
then describes each of them as shardwise metadata does: one segment ``[0, numel)`` of the saved
tensor ``KEY`` in a virtual file, served by :class:`MemoryReader` (the interface of
``fileio.ShardReader``). The one loader (``load.py``) and consolidation (``hf.py``) then read it
into any world size, stage or TP degree exactly as they read shardwise's own files: there is no
second loading path.

Every tensor is read and checked (shape, dtype, finite size) before the loader sees any of it, so
a load from a foreign checkpoint is as all-or-nothing as one from shardwise's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.fileio import CheckpointError, dtype_name

VIRTUAL = "<foreign>"  # the one virtual "file" every segment points at
FOREIGN = "foreign"  # meta["format"] of a checkpoint another library wrote


class MemoryReader:
    """``ShardReader``'s interface over tensors already read (and checked) from foreign files."""

    def __init__(self, source: Path, tensors: dict[str, torch.Tensor]):
        self.source, self.tensors = source, tensors

    def check(self, fname: str) -> None:
        if fname != VIRTUAL:
            raise CheckpointError(f"{self.source}: no file {fname!r} in this checkpoint")

    def _get(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        t = self.tensors.get(key)
        if t is None:
            raise CheckpointError(f"{self.source}: tensor {key} is not in the checkpoint")
        if t.dtype != dtype:
            raise CheckpointError(f"{self.source}: {key} is {dtype_name(t.dtype)}, expected {dtype_name(dtype)}")
        return t

    def read_range(self, key: str, segments: list[dict], lo: int, hi: int, out: torch.Tensor,
                   stored: torch.dtype | None = None) -> None:
        """As ``ShardReader.read_range``: ``stored`` is the promised dtype, converted into ``out``'s."""
        t = self._get(key, stored or out.dtype)
        if not 0 <= lo <= hi <= t.numel() or out.numel() != hi - lo:
            raise CheckpointError(f"{self.source}: {key} elements [{lo}, {hi}) are not all in the checkpoint")
        out.copy_(t[lo:hi])

    def read_full(self, key: str, fname: str, dtype: torch.dtype, shape: list[int],
                  stored: torch.dtype | None = None) -> torch.Tensor:
        return self._get(key, stored or dtype).view(shape).to(dtype, copy=True)

    def release(self) -> None:
        """Nothing is open: the tensors stay until the reader is dropped."""


def require_finite(v: Any, source: Path, where: str) -> None:
    """A loaded optimizer state or master must be finite: a NaN Adam ``step`` or moment would make
    every later update NaN, so it is refused here, naming the file and the key."""
    bad = not torch.isfinite(v).all() if torch.is_tensor(v) else not math.isfinite(v)
    if bad:
        raise CheckpointError(f"{source}: {where} holds a non-finite value (NaN or infinity); the run that "
                              "wrote it diverged: load an earlier checkpoint")


def _entry(shape: list[int], dtype: torch.dtype) -> dict:
    numel = math.prod(shape)
    segs = [{"file": VIRTUAL, "start": 0, "stop": numel}] if numel else []
    return {"shape": list(shape), "numel": numel, "dtype": dtype_name(dtype), "tp": None, "segments": segs}


@dataclass
class Foreign:
    """What a foreign reader found, by parameter name; :meth:`build` makes the shardwise view.

    ``trained``: name -> (full fp32 master, compute dtype); ``states``: state name -> name ->
    tensor (the master's shape); ``scalars``: name -> {"step": value}; ``extras``: frozen
    parameters and buffers, whole, in their own dtype.
    """

    source: Path
    world: int
    stage: int
    trained: dict[str, tuple[torch.Tensor, torch.dtype]] = field(default_factory=dict)
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    scalars: dict[str, dict[str, float]] = field(default_factory=dict)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    param_groups: list[dict] = field(default_factory=list)
    group_members: list[list[str]] = field(default_factory=list)  # names per param group, when saved
    lr_scheduler: dict | None = None
    global_steps: int = 0
    skipped_steps: int = 0
    client_state: Any = None

    def _check(self) -> None:
        for k, per in self.states.items():
            for name, t in per.items():
                master = self.trained.get(name)
                if master is None or t.shape != master[0].shape or not t.dtype.is_floating_point:
                    raise CheckpointError(f"{self.source}: optimizer state {k!r} of {name} does not match its "
                                          "parameter (shape or dtype)")
            if set(per) != set(self.trained):
                raise CheckpointError(f"{self.source}: optimizer state {k!r} is missing for "
                                      f"{sorted(set(self.trained) - set(per))[:3]}")
        if self.states and set(self.scalars) != set(self.trained):
            raise CheckpointError(f"{self.source}: optimizer 'step' missing for "
                                  f"{sorted(set(self.trained) - set(self.scalars))[:3]}")
        if dup := set(self.trained) & set(self.extras):
            raise CheckpointError(f"{self.source}: {sorted(dup)[:3]} saved both as trained and frozen")

    def build(self) -> tuple[dict, MemoryReader]:
        """Shardwise metadata (the fields ``load.py`` and ``hf.py`` read) and its reader."""
        self._check()
        tensors: dict[str, torch.Tensor] = {}
        meta_t, meta_f, scal = {}, {}, {}
        for name, (master, dtype) in self.trained.items():
            meta_t[name] = _entry(list(master.shape), dtype)
            tensors[f"master/{name}"] = master.detach().reshape(-1).float()
            for k, per in self.states.items():
                tensors[f"{k}/{name}"] = per[name].detach().reshape(-1)
            if self.states:
                scal[name] = {k: {"value": float(v), "dtype": "float32"} for k, v in self.scalars[name].items()}
        for name, t in self.extras.items():
            meta_f[name] = _entry(list(t.shape), t.dtype)
            tensors[f"frozen/{name}"] = t.detach().reshape(-1)
        order = [n for n in self.order if n in meta_t or n in meta_f]
        order += [n for n in [*meta_t, *meta_f] if n not in order]
        meta = {"format": FOREIGN, "version": 3, "order": order, "tensors": meta_t, "frozen": meta_f,
                "module": {}, "excluded_frozen": [], "tied": {},
                "layout": {"world": self.world, "dp": self.world, "tp": 1, "stage": self.stage,
                           "compute_dtype": None},
                "states": list(self.states), "scalars": scal,
                "state_dtypes": {k: dtype_name(next(iter(v.values())).dtype) if v else "float32"
                                 for k, v in self.states.items()},
                "files": {VIRTUAL: {}}, "param_groups": self.param_groups, "group_members": self.group_members,
                "lr_scheduler": self.lr_scheduler,
                "loss_scaler": None, "rng": [], "has_model_config": False, "client_state": self.client_state,
                "counters": {"global_steps": self.global_steps, "micro_steps": 0,
                             "skipped_steps": self.skipped_steps}}
        return meta, MemoryReader(self.source, tensors)
