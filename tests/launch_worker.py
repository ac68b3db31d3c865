"""A tiny training script for the launcher tests, run under `shardwise launch` (not a test itself).

Trains the tiny Llama at ZeRO stage 2 on fixed batches (batch k is a function of k only), saves a
checkpoint every 2 steps into OUT/ckpt and resumes from the latest one at start, so a restarted
job continues where it stopped. Rank 0 appends ``{"step", "loss", "attempt"}`` to OUT/losses.jsonl.
With KILL_AT=k, rank 1 of the first attempt kills itself (SIGKILL) inside step k.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import batches, build  # noqa: E402

import shardwise  # noqa: E402


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    kill_at = int(os.environ.get("KILL_AT", "-1"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    shardwise.init_distributed()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "overlap_comm": True}}
    engine, *_ = shardwise.initialize(model=build("llama"), config=cfg)
    rank, world = engine.global_rank if hasattr(engine, "global_rank") else int(os.environ["RANK"]), \
        int(os.environ["WORLD_SIZE"])
    start = 0
    if (out / "ckpt" / "latest").exists():
        _, client = engine.load_checkpoint(out / "ckpt")
        start = client["step"]
    data = batches(steps, 1, 2 * world, 16)
    for step in range(start, steps):
        ids = data[step, 0, rank * 2:(rank + 1) * 2]
        loss = engine(input_ids=ids, labels=ids).loss
        if step == kill_at and attempt == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        if rank == 0:
            with open(out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": total.item() / world, "attempt": attempt}) + "\n")
        if (step + 1) % 2 == 0:
            engine.save_checkpoint(out / "ckpt", client_state={"step": step + 1})


if __name__ == "__main__":
    main()
