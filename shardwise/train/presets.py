"""What `shardwise train` offers without any file of the user's: the model presets and the shipped text.

Kept free of torch and transformers so ``shardwise train --help`` (which lists them) answers at once.
"""

from __future__ import annotations

from pathlib import Path

MODEL_PRESETS: dict[str, dict[str, int]] = {
    # ~0.4M parameters: tests (a run of a few steps takes seconds).
    "llama-micro": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2),
    # ~3M parameters: `make run` (a few minutes of CPU for a few hundred steps on 2 ranks).
    "llama-tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2),
    # ~20M parameters: the benchmark model.
    "llama-20m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4),
}

REPO_DATA = Path(__file__).resolve().parent.parent.parent / "data" / "sonnets.txt"
