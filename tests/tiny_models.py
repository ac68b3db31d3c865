"""Tiny HF models with dropout off, for equivalence tests (built from configs, no download)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

VOCAB = 509  # not divisible by 2 or 4: exercises padding


def build(kind: str, seed: int = 0, vocab: int = VOCAB) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=False)
    elif kind == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        raise ValueError(kind)
    cfg.attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def batches(steps: int, gas: int, global_micro: int, seq: int, seed: int = 1, vocab: int = VOCAB):
    """Token ids shaped [steps, gas, global_micro, seq]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, gas, global_micro, seq), generator=g)
