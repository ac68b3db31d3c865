"""Regenerate ``ds_losses.json``: DeepSpeed 0.19.8's losses for the pipeline scripts of tests/pipeline_cases.py.

Needs a venv with DeepSpeed (never the project's own), on 4 CPU ranks over gloo::

    cd tests/data/pipeline && DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=../../.. \
        /work/dsvenv/bin/torchrun --nproc-per-node 4 make_fixture.py

Each case of ``DS_CASES`` builds the same ``PipelineModule`` with DeepSpeed's own classes
(``deepspeed.pipe``), trains 3 batches with ``engine.train_batch`` and records the losses it returned
and the partition (``module.parts``). tests/test_pipeline.py runs the same cases through shardwise's
facade and compares (1e-5 relative).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/
import pipeline_cases as pc  # noqa: E402


def run(stages: int, config: dict | None = None, tied: bool = False, partition: str = "parameters",
        interval: int = 0, steps: int = 3) -> dict:
    import deepspeed
    from deepspeed import pipe

    cfg = {**pc.CONFIG, **(config or {}), "zero_allow_untested_optimizer": True}
    model = pipe.PipelineModule(pc.specs(tied, pipe), num_stages=stages, loss_fn=F.mse_loss, seed_layers=True,
                                seed_fn=torch.manual_seed, base_seed=pc.BASE_SEED, partition_method=partition,
                                activation_checkpoint_interval=interval)
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    dp_rank = engine.grid.get_data_parallel_id()
    losses = [float(engine.train_batch(pc.batches(s, dp_rank, cfg))) for s in range(steps)]
    return {"losses": losses, "parts": [int(p) for p in model.parts]}


def main() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "world": dist.get_world_size(),
           "cases": {}}
    for name, kwargs in pc.DS_CASES.items():
        torch.manual_seed(0)
        out["cases"][name] = run(**kwargs)
    if dist.get_rank() == 0:
        (HERE / "ds_losses.json").write_text(json.dumps(out, indent=1) + "\n")
    dist.barrier()


if __name__ == "__main__":
    main()
