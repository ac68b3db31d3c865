"""A DeepSpeed-style script that ends without destroying the process group (launcher tests).

``python -m torch.distributed.run --nproc_per_node 2 exit_worker.py MODE``: trains the tiny Llama
for a few steps with tensor parallelism 2 (``tp``) or ZeRO-2 with overlapped reduction (``zero``)
and a tqdm bar on rank 0, then returns. ``error``: rank 1 raises after the first step (a clean
error); rank 0 then fails its next collective. No rank may die of SIGABRT at exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import batches, build  # noqa: E402

import shardwise  # noqa: E402


def main(mode: str) -> None:
    shardwise.init_distributed()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5000}}
    if mode == "tp":
        cfg["tensor_parallel"] = {"autotp_size": 2}
        cfg["zero_optimization"] = {"stage": 0}
    engine, *_ = shardwise.initialize(model=build("llama"), config=cfg)
    import torch.distributed as dist

    rank = dist.get_rank()
    data = batches(4, 1, 4, 16)
    for step in tqdm(range(4), disable=rank != 0):
        ids = data[step, 0, :2] if mode == "tp" else data[step, 0, rank * 2:(rank + 1) * 2]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if mode == "error" and rank == 1 and step == 1:
            raise ValueError("a clean error in rank 1")


if __name__ == "__main__":
    main(sys.argv[1])
