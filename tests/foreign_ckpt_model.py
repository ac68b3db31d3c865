"""The model, data and hyperparameters shared by the foreign-checkpoint fixtures and their tests.

``tests/data/foreign_ckpt/make_fixtures.py`` trains this model with real DeepSpeed and with FSDP2
(and records the losses they produce when continuing); ``tests/test_checkpoint_foreign.py``
continues the same run on shardwise from those files. Importable without DeepSpeed.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB, SEQ, GLOBAL_MICRO = 61, 12, 4  # 4 sequences per step: 2 per rank at world 2
STEPS, SAVE_AT = 4, 2  # train 2 steps, save, continue 2 (the recorded "continued" losses)
FROZEN = "model.layers.0.mlp.up_proj.weight"  # frozen in the "frozen" fixtures
ADAMW = {"lr": 2e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
WARMUP = {"warmup_min_lr": 2e-3, "warmup_max_lr": 2e-2, "warmup_num_steps": 6, "warmup_type": "linear"}


def build(seed: int = 0, frozen: bool = False) -> torch.nn.Module:
    """A 3390-parameter Llama with odd sizes (hidden 15, vocab 61, head_dim 4, intermediate 23), so
    DeepSpeed's flat partitions and stage-3 per-parameter partitions get padded at world 2.
    Llama has no dropout; no persistent buffers."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=15, intermediate_size=23, num_hidden_layers=1,
                      num_attention_heads=3, num_key_value_heads=1, head_dim=4, max_position_embeddings=32,
                      tie_word_embeddings=False)
    cfg.attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg)
    if frozen:
        model.get_parameter(FROZEN).requires_grad_(False)
    model.train()
    return model


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's token ids at ``step``: its contiguous slice of the global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_MICRO, SEQ), generator=g)
    micro = GLOBAL_MICRO // world
    return ids[rank * micro:(rank + 1) * micro]


def ds_config(stage: int, world: int, bf16: bool = False) -> dict:
    """The DeepSpeed JSON config both libraries run (shardwise speaks it): no clipping (DeepSpeed's
    default is 1.0), WarmupLR so a resume that drops the scheduler state shows in the losses."""
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_MICRO // world, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
           "scheduler": {"type": "WarmupLR", "params": dict(WARMUP)}, "steps_per_print": 10**9}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg
