"""Sequence-parallel cases run on every rank of the pool (tests/test_sequence_parallel.py)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from shardwise.sequence_parallel import SequenceParallel, register_attention, sequence_parallel_loss, split_batch

VOCAB = 509


def llama(impl: str = "sdpa", kv_heads: int = 1, heads: int = 4, seed: int = 0) -> torch.nn.Module:
    """A tiny HF Llama, dropout off; kv_heads 1 < SP 2 exercises kv replication."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                      tie_word_embeddings=False)
    cfg._attn_implementation = impl
    model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def sample_batch(b: int, seq: int, seed: int = 1, pad_from: int | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if pad_from is not None:  # the last sample is right padded from pad_from on
        mask = torch.ones_like(ids)
        mask[-1, pad_from:] = 0
        batch["attention_mask"] = mask
        batch["labels"][-1, pad_from:] = -100
    return batch


def reference_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """HF's own causal-LM loss on the whole batch (mean over real target tokens)."""
    return model(**batch).loss


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sp_matches_whole(impl: str, kv_heads: int, seq: int, pad_from: int | None = None) -> dict:
    """SP 2 forward + backward (gradients summed over the SP group) against the whole batch in one process."""
    sp = SequenceParallel.of_size(dist.get_world_size())
    model = llama(impl, kv_heads)
    batch = sample_batch(2, seq, pad_from=pad_from)
    ref_model = copy.deepcopy(model)
    ref = reference_loss(ref_model, batch)
    ref.backward()
    register_attention(model, sp)
    shard = split_batch(batch, sp)
    labels = shard.pop("shift_labels")
    loss = sequence_parallel_loss(model(**shard).logits, labels, sp)
    loss.backward()
    got = _grads(model)
    for g in got.values():
        dist.all_reduce(g, group=sp.group)
    want = _grads(ref_model)
    assert got.keys() == want.keys()
    return {"loss": abs(float(loss) - float(ref)) / abs(float(ref)),
            "grad": max(_rel(got[n], want[n]) for n in want)}
