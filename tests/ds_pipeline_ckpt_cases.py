"""Rank-side cases for tests/test_ds_pipeline_ckpt.py: DeepSpeed 0.19.8's PipelineModule checkpoint
(tests/data/pipeline_ckpt, PP 2 at ZeRO-1) loaded into shardwise's pipeline engine at any number of
stages, then trained on as DeepSpeed's own run went on after its save."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from pipeline_cases import BASE_SEED, CONFIG, batches, specs

FIXTURES = Path(__file__).resolve().parent / "data" / "pipeline_ckpt"


def resume(stages: int, load_optimizer_states: bool = True, fixture: str = "z1") -> dict:
    """Load the fixture (``z1``: PP 2; ``z1_dp2``: PP 2 x DP 2; ``z1_tied``: PP 2 with a weight tied across
    the stages) at ``stages`` stages (ZeRO-1, the fixture's config): this stage's weights against
    DeepSpeed's (bit for bit, by name), then batches 3-4, which DeepSpeed's run took right after its save."""
    from safetensors.torch import load_file

    import shardwise
    from shardwise.pipeline import PipelineModule

    FIXTURE = FIXTURES / fixture  # noqa: N806
    model = PipelineModule(specs(fixture.endswith("tied")), num_stages=stages, loss_fn=F.mse_loss, seed_layers=True,
                           seed_fn=torch.manual_seed, base_seed=BASE_SEED)
    config = {**CONFIG, "zero_optimization": {"stage": 1}}
    engine, *_ = shardwise.initialize(model=model, config=config)
    engine.load_checkpoint(str(FIXTURE), load_optimizer_states=load_optimizer_states)
    ref = load_file(str(FIXTURE / "reference.safetensors"))
    engine.wait_for_params()
    with shardwise.zero.GatheredParameters(list(model.parameters())):
        mine = {n: p.detach().clone() for n, p in model.named_parameters()}
    differ = sorted(n for n, p in mine.items() if not torch.equal(p, ref[f"layer.{n}"]))
    dp, steps = engine.grid.get_data_parallel_id(), engine.global_steps
    losses = [float(engine.train_batch(batches(s, dp, config))) for s in (2, 3)]
    return {"names": sorted(mine), "differ": differ, "losses": losses, "stage": engine.stage_id,
            "steps": steps, "ds": json.loads((FIXTURE / "losses.json").read_text())}


def straight(stages: int) -> list[float]:
    """The fixture's run here without a save: 4 batches from the seeded layers (DeepSpeed's before + after)."""
    import shardwise
    from shardwise.pipeline import PipelineModule

    model = PipelineModule(specs(), num_stages=stages, loss_fn=F.mse_loss, seed_layers=True,
                           seed_fn=torch.manual_seed, base_seed=BASE_SEED)
    config = {**CONFIG, "zero_optimization": {"stage": 1}}
    engine, *_ = shardwise.initialize(model=model, config=config)
    dp = engine.grid.get_data_parallel_id()
    return [float(engine.train_batch(batches(s, dp, config))) for s in range(4)]
