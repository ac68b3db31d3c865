"""Rank-side runs for test_zeropp.py: quantized collectives alone, and training with and without them."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise
from shardwise.cli.train_job import REPO_DATA, ByteTextDataset
from shardwise.comm import Comm
from shardwise.zero.quantized_comm import (
    BLOCK,
    quantize,
    quantized_all_gather,
    quantized_reduce_scatter,
)


def rank_data(n: int, seed: int) -> torch.Tensor:
    """Rank-specific values over several magnitudes (so block scales differ a lot)."""
    g = torch.Generator().manual_seed(seed + 1000 * dist.get_rank())
    return torch.randn(n, generator=g) * torch.logspace(-3, 2, n)[torch.randperm(n, generator=g)]


def collectives(bits: int, shard: int, async_op: bool) -> dict:
    """Run qwZ and qgZ once; return what each rank got plus the exact values to compare with."""
    comm, n = Comm(), dist.get_world_size()
    mine = rank_data(shard, seed=1)
    before = mine.clone()
    flat = torch.full((n * shard,), float("nan"))
    w = quantized_all_gather(comm, mine, flat, 8, async_op=async_op)
    if w is not None:
        w.wait()
    full = rank_data(n * shard, seed=2)
    out = torch.ones(shard)
    w = quantized_reduce_scatter(comm, full.clone(), out, bits, async_op=async_op, accumulate=True)
    if w is not None:
        w.wait()
    scales = quantize(full.view(n, shard), bits)[1]  # this rank's scales for every destination
    return {"gathered": flat, "shard_after": mine, "shard_before": before, "full": full,
            "reduced_plus_one": out, "scales": scales, "stats": comm.stats.as_dict()}


def tiny_llama(seq: int, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    cfg.attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg)


def sonnets_config(stage: int, micro: int, lr: float, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}


def train_sonnets(config: dict, steps: int, seq: int = 32, seed: int = 0) -> dict:
    """Train the tiny Llama byte-level on the shipped sonnets; the same batches for every config."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = config["train_micro_batch_size_per_gpu"]
    data = ByteTextDataset(REPO_DATA, seq)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    engine, *_ = shardwise.initialize(model=tiny_llama(seq, seed), config=config)
    losses = []
    for s in range(steps):
        idx = [order[(s * micro * world + rank * micro + i) % len(data)] for i in range(micro)]
        ids = torch.stack([data[int(i)]["input_ids"] for i in idx])
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "comm": engine.comm_stats(), "block": BLOCK}


def gathered_parameters_are_exact() -> dict:
    """qwZ at stage 3: GatheredParameters shows the true weights, the forward gather dequantized ones."""
    from tiny_models import build
    from zero_cases import make_config

    from shardwise.zero import GatheredParameters

    engine, *_ = shardwise.initialize(model=build("llama"), config=make_config(
        3, zero_quantized_weights=True, stage3_param_persistence_threshold=0))
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    groups = [g for gs in engine.unit_groups for g in gs]
    exact, quantized = True, True
    for g in groups:
        with GatheredParameters(g.params):
            own = g.flat_param.narrow(0, g.own_start, g.own_numel)
            exact &= torch.equal(own, g.param_shard) and torch.equal(g.param_shard, g.master)
        g.gather()  # as the forward does
        own = g.flat_param.narrow(0, g.own_start, g.own_numel)
        quantized &= not torch.equal(own, g.param_shard)
        g.release()
    return {"exact": exact, "quantized": quantized, "groups": len(groups)}
