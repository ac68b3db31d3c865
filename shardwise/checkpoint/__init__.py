"""Sharded checkpoints: save from any layout, load into any layout, export to Hugging Face format.

Public API (the engine's ``save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model`` call these):

- :func:`save_checkpoint` / :func:`load_checkpoint`: collective, every rank reads and writes only
  its own shards; see ``docs/checkpoints.md`` for the on-disk format. A save may be asynchronous
  (``checkpoint/async_save.py``): :func:`wait_for_checkpoint` publishes it, :func:`poll_checkpoint`
  (the engine's ``step``) publishes it once written, without waiting.
- :func:`consolidate`: offline, single process, streams tensor by tensor.
- :func:`save_16bit_model`: HF weights from a live engine.
- :func:`gather_experts`: an expert-parallel parameter's full tensor (every EP rank's experts);
  :func:`gather_rows`: the same for a tensor and the EP ``Comm``.
- :func:`confined_path` / :func:`read_weight_map`: names read from files must stay in their folder
  (also used by the safetensors readers of ``zero.Init`` and ZeRO-Inference).
"""

from __future__ import annotations

from shardwise.checkpoint.async_save import poll_checkpoint, wait_for_checkpoint
from shardwise.checkpoint.experts import gather_experts, gather_rows
from shardwise.checkpoint.fileio import CheckpointError
from shardwise.checkpoint.hf import consolidate, save_16bit_model
from shardwise.checkpoint.load import load_checkpoint
from shardwise.checkpoint.save import save_checkpoint
from shardwise.checkpoint.validate import confined_path
from shardwise.files.model_folder import read_weight_map

__all__ = ["CheckpointError", "confined_path", "consolidate", "gather_experts", "gather_rows",
           "load_checkpoint", "poll_checkpoint", "read_weight_map", "save_16bit_model", "save_checkpoint",
           "wait_for_checkpoint"]

