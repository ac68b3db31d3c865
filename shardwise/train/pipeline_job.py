"""`shardwise train --pp N`: the loop's engine calls when the model is split into pipeline stages.

``shardwise.initialize`` splits the Hugging Face model by decoder layers (``pipeline.stages``,
``shardwise/pipeline/hf.py``) and returns a :class:`~shardwise.pipeline.PipelineEngine`, which
takes a whole batch at once: a step is ``train_batch`` over the step's micro-batches (the first
stage reads the inputs, the last the labels), an eval or probe forward is ``eval_batch`` of one
micro-batch. The sample and the ``hf/`` export need the whole model: every stage's parameters
(gathered over its data-parallel group at ZeRO-3) are sent to every rank under the model's own
names and copied into the model the run built (each rank has it whole: the stages were cut from
it), which then generates and is saved with ``save_pretrained`` (tied embeddings stay tied: the
last stage's copy of the embedding is the first stage's, under the embedding's name).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm import make_comm
from shardwise.engine import NonFiniteError
from shardwise.errors import UserError
from shardwise.fsdp import full_state_dict
from shardwise.pipeline import pipeline_stages


def stages_of(ds_config: dict) -> int:
    """The config's ``pipeline.stages`` (1 without one)."""
    return pipeline_stages(ds_config)


def is_pipeline(engine: Any) -> bool:
    """Whether ``engine`` is one stage of a pipeline of two or more."""
    return getattr(engine, "num_stages", 1) > 1


def check_layout(ds_config: dict, world: int) -> None:
    """Refuse, before any work, a pipeline the world cannot hold or the train job does not serve."""
    pp = stages_of(ds_config)
    if pp == 1:
        return
    if world % pp:
        raise UserError(f"--pp {pp}: the world of {world} ranks is not divisible into {pp} pipeline stages")
    unserved = {"--sp / sequence_parallel_size": (ds_config.get("sequence_parallel_size") or 1) > 1,
                "--ep / expert_parallel": bool((ds_config.get("expert_parallel") or {}).get("enabled")),
                "tensor_parallel.autotp_size": ((ds_config.get("tensor_parallel") or {}).get("autotp_size") or 1) > 1}
    for what, on in unserved.items():
        if on:
            raise UserError(f"--pp {pp} with {what} is not served by shardwise train; drop one of them")


def whole_model(engine: Any, model: nn.Module) -> nn.Module | None:
    """The model the stages were cut from, kept for the sample and the export (None without stages)."""
    return model if is_pipeline(engine) else None


def train_batch(engine: Any, micro: list[torch.Tensor]) -> tuple[float, float | None]:
    """One step over ``micro`` (each its own labels): ``(mean loss, None)``, or ``(nan, norm)`` when
    the gradient norm was non-finite past the engine's allowance (the weights are untouched)."""
    try:
        return float(engine.train_batch(iter([(mb, mb) for mb in micro]))), None
    except NonFiniteError as e:
        return math.nan, e.value


def eval_sums(engine: Any, batches: list[torch.Tensor]) -> torch.Tensor:
    """``[loss * predictions, predictions]`` of this rank's turns over ``batches`` (the last stage
    counts them; the other stages add zeros), for the world all-reduce of ``loop.evaluate``."""
    dp, rank = engine.dp_world, engine.dp_rank
    sums = torch.zeros(2, dtype=torch.float64, device=engine.device)
    for r in range(-(-len(batches) // dp)):
        i = r * dp + rank
        mb = batches[i if i < len(batches) else 0]
        losses = engine.eval_batch(iter([(mb, mb)]), reduce_output=None, num_micro_batches=1)
        if i < len(batches) and engine.is_last_stage():
            n = mb.shape[0] * (mb.shape[1] - 1)
            sums += torch.tensor([float(losses[0]) * n, n], dtype=torch.float64, device=engine.device)
    return sums


def probe(engine: Any, mb: torch.Tensor) -> float:
    """The loss of one sequence, on every stage (the last stage's, sent to the others)."""
    return float(engine.eval_batch(iter([(mb, mb)]), num_micro_batches=1))


@dataclass
class Whole:
    """The gathered model as ``loop.sample`` calls an engine (``module``, ``device``, ``generate``)."""

    module: nn.Module
    device: torch.device

    def generate(self, **kwargs: Any) -> torch.Tensor:
        return self.module.generate(**kwargs)


def gather_whole(engine: Any, model: nn.Module) -> Whole:
    """Every stage's parameters copied into ``model`` on every rank, in the compute dtype (collective)."""
    names = engine.module.hf_names
    state = full_state_dict(engine.module, rank0_only=False)  # this stage's, whole (ZeRO-3: gathered)
    mine = {names[k]: v for k, v in state.items() if k in names} if engine.dp_rank == 0 else {}
    parts: list[Any] = [None] * dist.get_world_size()
    make_comm().all_gather_object(parts, mine)
    merged = {k: v for part in parts for k, v in part.items()}
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(merged))
    if missing:
        raise UserError(f"--pp: the stages hold no {missing[:3]} ({len(missing)} tensors); the model cannot be "
                        "gathered for the sample and the export")
    dtype = engine.compute_dtype
    model.to(device=engine.device, dtype=dtype)
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(merged[name])
    model.eval()
    return Whole(model, engine.device)


def save_hf(engine: Any, whole: Whole | None, folder: Path) -> None:
    """The HF export (collective): the engine's ``save_16bit_model`` without stages; with them the
    gathered model (rank 0 writes config.json and model.safetensors beside ``folder``, then renames
    the folder into place once every file is on disk)."""
    if whole is None:
        engine.save_16bit_model(folder)
        return
    if dist.get_rank() == 0:
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        whole.module.save_pretrained(str(tmp), safe_serialization=True)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    make_comm().barrier()
