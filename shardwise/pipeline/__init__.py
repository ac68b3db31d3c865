"""``shardwise.pipeline``: pipeline parallelism, DeepSpeed's ``deepspeed.pipe`` API (docs/pipeline.md).

- ``topology``: ``ProcessTopology``, ``PipeDataParallelTopology``, ``PipeModelDataParallelTopology``
  and the grid of groups (``engine.grid``); ``spec``: ``LayerSpec``, ``TiedLayerSpec``, the partition
  methods; ``module``: ``PipelineModule`` (each rank builds its stage's layers only);
- ``schedule``: 1F1B, GPipe, interleaved 1F1B and zero-bubble ZB-H1 (``zb_h1``, whose backward ``split``
  cuts in two and ``zero_bubble`` runs); ``wire``: the transfers between stages; ``tied``: tied weights
  across stages; ``engine``: ``PipelineEngine`` (``train_batch`` / ``eval_batch``) on shardwise's
  engine; ``build``: what ``shardwise.initialize(model=PipelineModule)`` returns; ``hf``: a Hugging Face
  causal LM split into stages (``pipeline.stages``); ``entry``: ``shardwise.initialize`` itself.
"""

from __future__ import annotations

from shardwise.pipeline.build import build_pipeline_engine
from shardwise.pipeline.engine import PipelineEngine
from shardwise.pipeline.entry import initialize
from shardwise.pipeline.hf import causal_lm_loss, pipeline_stages, split_causal_lm
from shardwise.pipeline.module import PipelineModule
from shardwise.pipeline.schedule import SCHEDULES, bubble_fraction
from shardwise.pipeline.spec import LayerSpec, TiedLayerSpec, partition_balanced, partition_uniform
from shardwise.pipeline.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from shardwise.pipeline.wire import StageTransferError

# shardwise.initialize() builds a PipelineModule's engine through this (the engine package never imports this one)
PipelineModule.engine_builder = staticmethod(build_pipeline_engine)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineEngine",
           "PipelineModule", "PipelineParallelGrid", "ProcessTopology", "SCHEDULES", "StageTransferError",
           "TiedLayerSpec", "bubble_fraction", "build_pipeline_engine", "causal_lm_loss", "initialize",
           "pipeline_stages", "split_causal_lm", "partition_balanced", "partition_uniform"]
