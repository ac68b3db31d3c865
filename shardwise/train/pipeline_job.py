"""`shardwise train --pp N`: the loop's engine calls when the model is split into pipeline stages.

``shardwise.initialize`` splits the Hugging Face model by decoder layers (``pipeline.stages``,
``shardwise/pipeline/hf.py``) and returns a :class:`~shardwise.pipeline.PipelineEngine`, which
takes a whole batch at once: a step is ``train_batch`` over the step's micro-batches (the first
stage reads the inputs, the last the labels), an eval or probe forward is ``eval_batch`` of one
micro-batch. No rank holds the whole model: it is built under ``stage_init()`` (every parameter on
meta, this rank's stage made real by ``initialize``, the whole build's values bit for bit), the
sample is ``engine.generate`` decoded through the stages (``pipeline/generate.py``: HF's tokens),
and the ``hf/`` export is one safetensors shard per stage, written by the stage's first
data-parallel rank, plus the index and config.json from rank 0 (tied embeddings stay tied: the
last stage's copy is not written, the embedding's owner writes it).
"""

from __future__ import annotations

import contextlib
import json
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
from shardwise.pipeline import StageStopped, pipeline_stages, stage_init
from shardwise.train.divergence import DivergedError


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
    """The model object the stages were cut from (its config; only this stage's parameters real), kept
    for the sample and the export (None without stages)."""
    return model if is_pipeline(engine) else None


def stage_note(engine: Any, model: nn.Module) -> str:
    """What rank 0 made real of the model: its stage's parameters only (``stage_init``)."""
    real = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return (f"pipeline stage {engine.stage_id}: {real:,} of the model's {total:,} parameter bytes made real on "
            f"this rank (its stage's; the other stages' stay on the meta device)")


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


def building(ds_config: dict) -> Any:
    """The context the model is built in: with stages, :func:`shardwise.pipeline.stage_init` (every
    parameter on meta; ``initialize`` makes this rank's stage's real, the whole build's values bit for
    bit); without, nothing."""
    return stage_init() if stages_of(ds_config) > 1 else contextlib.nullcontext()


@dataclass
class Staged:
    """The pipeline as ``loop.sample`` calls an engine (``module``, ``device``, ``generate``): the model
    object (its config; only this stage's parameters real) and the decode through the stages."""

    engine: Any
    module: nn.Module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def generate(self, **kwargs: Any) -> torch.Tensor:
        """``engine.generate`` (collective over the pipeline); the last stage's non-finite-logits stop
        is each stage's :class:`DivergedError`."""
        try:
            return self.engine.generate(**kwargs)
        except StageStopped as e:
            if e.kind == DivergedError.__name__:
                raise DivergedError(str(e)) from None
            raise


def staged(engine: Any, model: nn.Module) -> Staged:
    return Staged(engine, model)


def _stage_tensors(engine: Any) -> dict[str, torch.Tensor]:
    """This stage's tensors under the model's own names, in the compute dtype (ZeRO-3: gathered over the
    stage's data-parallel group; collective there). A tied copy is left to the stage that owns it."""
    names = engine.module.hf_names
    copies = {id(w) for _, stages, weights in engine.tied.ties if engine.stage_id != stages[0] for w in weights}
    skip = {n for n, p in engine.module.named_parameters(remove_duplicate=False) if id(p) in copies}
    state = full_state_dict(engine.module, rank0_only=False)
    dtype = engine.compute_dtype
    return {names[k]: v.to(dtype).contiguous() for k, v in state.items() if k in names and k not in skip}


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def save_hf(engine: Any, model: nn.Module | None, folder: Path) -> None:
    """The HF export (collective): the engine's ``save_16bit_model`` without stages. With them no rank
    gathers another stage: each stage's first data-parallel rank writes its own tensors as one shard
    (``model-0000s-of-0000p.safetensors``, fsynced), then rank 0 writes the index and ``config.json``
    and renames the folder into place; plain ``from_pretrained`` loads it."""
    from safetensors.torch import save_file

    if model is None:
        engine.save_16bit_model(folder)
        return
    comm, tmp = make_comm(), folder.with_name(folder.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()
    mine = _stage_tensors(engine)
    shard = f"model-{engine.stage_id + 1:05d}-of-{engine.num_stages:05d}.safetensors"
    sizes: dict[str, int] = {}
    if engine.dp_rank == 0:
        save_file(mine, str(tmp / shard), metadata={"format": "pt"})
        _fsync(tmp / shard)
        sizes = {k: v.numel() * v.element_size() for k, v in mine.items()}
    del mine
    parts: list[Any] = [None] * dist.get_world_size()
    comm.all_gather_object(parts, (shard, sizes))
    if dist.get_rank() == 0:
        _write_index(tmp, model, [p for p in parts if p[1]], engine.compute_dtype)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    comm.barrier()


def _write_index(tmp: Path, model: nn.Module, parts: list[tuple[str, dict[str, int]]], dtype: torch.dtype) -> None:
    """``model.safetensors.index.json`` (every tensor's shard) and ``config.json``, fsynced."""
    weight_map = {name: shard for shard, sizes in sorted(parts) for name in sizes}
    missing = sorted({n for n, _ in model.named_parameters()} - set(weight_map)
                     - ({"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()))
    if missing:
        raise UserError(f"--pp: the stages hold no {missing[:3]} ({len(missing)} tensors); the model cannot be "
                        "exported")
    index = {"metadata": {"total_size": sum(sum(s.values()) for _, s in parts)}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    model.config.dtype = dtype
    model.config.architectures = [type(model).__name__]  # as save_pretrained writes it
    model.config.save_pretrained(str(tmp))
    for f in ("model.safetensors.index.json", "config.json"):
        _fsync(tmp / f)
