"""Rank-side case of tests/test_zero_to_fp32_script.py: a stage-3 run that saves a checkpoint the
way the HF Trainer does (``checkpoint-N/`` with ``latest`` and a tag folder) and returns the live
gathered weights to compare the script's output with."""

from __future__ import annotations

import torch
from tiny_models import build

import shardwise
from shardwise.zero import GatheredParameters


def train_and_save(folder: str) -> dict[str, torch.Tensor]:
    model = build("llama")
    model.model.embed_tokens.weight.requires_grad_(False)  # a frozen parameter, for --exclude_frozen_parameters
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = shardwise.initialize(model=model, config=cfg,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    for step in range(2):
        ids = (torch.arange(8).view(1, 8) * (step + 3) + torch.distributed.get_rank()) % 500
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(folder)  # tag global_step2, as the Trainer's checkpoint-2/
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}
