"""The DeepSpeed config ``shardwise train`` uses when given none (``--config`` and a run config's
``config`` both absent), as torchtitan's debug config lets a first run start from a model and data.

Chosen to start anywhere: no ``train_batch_size`` and no accumulation, so the DeepSpeed batch rule
(``train_batch_size = micro x accumulation x data-parallel ranks``) holds at every ``--nproc``; ZeRO
stage 2 (optimizer state and gradients sharded, parameters whole: the usual first choice on one
node); AdamW with a short linear warmup and a linear decay to 0 over ``--steps``; gradient clipping
at 1.0. The resolved config is printed at the start and saved in ``RUN/run_config.json``, so the
run is repeatable with ``--run-config RUN/run_config.json`` even if these defaults change.
Kept free of torch: ``train --help`` shows them.
"""

from __future__ import annotations

from typing import Any

MICRO_BATCH = 4  # sequences per rank per step
LR = 1e-3
STAGE = 2
SUMMARY = (f"ZeRO stage {STAGE}, AdamW lr {LR:g} (warmup 10% of --steps, then linear decay), "
           f"{MICRO_BATCH} sequences per rank per step, gradient clipping 1.0")


def default_config(steps: int) -> dict[str, Any]:
    """The config for a run of ``steps`` optimizer steps (the schedule's lengths depend on it)."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": 1.0,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": max(1, steps // 10),
                                 "total_num_steps": steps, "warmup_type": "linear"}},
        "zero_optimization": {"stage": STAGE},
    }
