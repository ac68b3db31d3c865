"""``shardwise.pipeline``: pipeline parallelism, DeepSpeed's ``deepspeed.pipe`` API (docs/pipeline.md).

- ``topology``: ``ProcessTopology``, ``PipeDataParallelTopology``, ``PipeModelDataParallelTopology``
  and the grid of groups (``engine.grid``; ``current_grid()`` while a ``PipelineModule``'s layers are
  built); ``spec``: ``LayerSpec``, ``TiedLayerSpec``, the partition
  methods; ``module``: ``PipelineModule`` (each rank builds its stage's layers only);
- ``schedule``: 1F1B, GPipe, interleaved 1F1B and zero-bubble ZB-H1 (``zb_h1``, whose backward ``split``
  cuts in two and ``zero_bubble`` runs); ``wire``: the transfers between stages; ``tied``: tied weights
  across stages; ``engine``: ``PipelineEngine`` (``train_batch`` / ``eval_batch``) on shardwise's
  engine; ``build``: what ``shardwise.initialize(model=PipelineModule)`` returns; ``hf``: a Hugging Face
  causal LM split into stages (``pipeline.stages``); ``stage_init``: such a model built with only this
  rank's stage's parameters made real; ``generate``: ``engine.generate()`` decoded through the stages;
  ``entry``: ``shardwise.initialize`` itself.
"""

from __future__ import annotations

from shardwise.pipeline.build import build_pipeline_engine
from shardwise.pipeline.engine import PipelineEngine
from shardwise.pipeline.entry import initialize
from shardwise.pipeline.generate import StageStopped
from shardwise.pipeline.hf import causal_lm_loss, pipeline_stages, split_causal_lm
from shardwise.pipeline.module import PipelineModule, set_random_seed
from shardwise.pipeline.schedule import SCHEDULES, bubble_fraction
from shardwise.pipeline.spec import LayerSpec, TiedLayerSpec, partition_balanced, partition_uniform
from shardwise.pipeline.stage_init import materialize_stage, stage_init
from shardwise.pipeline.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
    current_grid,
)
from shardwise.pipeline.wire import StageTransferError

# shardwise.initialize() builds a PipelineModule's engine through this (the engine package never imports this one)
PipelineModule.engine_builder = staticmethod(build_pipeline_engine)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineEngine",
           "PipelineModule", "PipelineParallelGrid", "ProcessTopology", "SCHEDULES", "StageStopped",
           "StageTransferError", "TiedLayerSpec", "bubble_fraction", "build_pipeline_engine", "causal_lm_loss",
           "current_grid", "initialize", "materialize_stage", "pipeline_stages", "split_causal_lm", "stage_init",
           "partition_balanced", "partition_uniform", "set_random_seed"]
