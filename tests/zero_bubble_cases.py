"""Cases for tests/test_pipeline_zero_bubble.py: the zero-bubble schedule (``pipeline.schedule: "zb_h1"``) on
the pools' ranks, beside 1F1B, with the layers of tests/pipeline_cases.py."""

from __future__ import annotations

import pipeline_cases as pc
import torch.nn.functional as F

ZB = {"pipeline": {"schedule": "zb_h1"}}


def with_zb(config: dict | None = None) -> dict:
    return {**(config or {}), **ZB}


def zb_and_1f1b(stages: int, config: dict | None = None, **kwargs) -> tuple[dict, dict]:
    """The same run under zb_h1 and under 1F1B (the default), on this rank."""
    return pc.train(stages, config=with_zb(config), **kwargs), pc.train(stages, config=config, **kwargs)


class ReentrantBlock(pc.Block):
    """A layer that checkpoints itself the reentrant way (as some models' own gradient checkpointing does)."""

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().forward, x, use_reentrant=True)


def refusals() -> list[str]:
    """Each rank's line for zb_h1 with activation checkpointing, with ZeRO-2's per-micro-batch reduction, and
    with layers that checkpoint themselves reentrantly."""
    import shardwise
    from shardwise.pipeline import LayerSpec, PipelineModule

    lines = []  # (the reentrant layers at 1 stage x DP 2: a refusal mid-batch at 2 stages would leave the
    # neighbour's activations unreceived in the pool's pipeline group)
    for interval, zero, layers, stages in ((2, 0, pc.specs(), 2), (0, 2, pc.specs(), 2),
                                           (0, 0, [LayerSpec(pc.Block), LayerSpec(ReentrantBlock)], 1)):
        model = PipelineModule(layers, num_stages=stages, loss_fn=F.mse_loss, activation_checkpoint_interval=interval)
        engine, *_ = shardwise.initialize(model=model, config=with_zb({**pc.CONFIG, "zero_optimization":
                                                                        {"stage": zero}}))
        try:
            engine.set_reduce_once(False)
            engine.train_batch(pc.batches(0, 0, pc.CONFIG))
            lines.append("none")
        except Exception as e:  # noqa: BLE001 - the line is what is checked
            lines.append(f"{type(e).__name__}: {e}")
    return lines


def lm_zb_and_1f1b(stages: int, tied: bool, steps: int = 2) -> list[tuple[list[float], dict]]:
    """A Hugging Face Llama split by ``pipeline.stages`` (attention, RMSNorm, rotary embeddings; with ``tied`` the
    embedding on stage 0 is the head on the last): each schedule's losses and this stage's final weights."""
    import pipeline_script_cases as psc

    import shardwise

    out = []
    for schedule in ("zb_h1", "1f1b"):
        model = psc.tiny_lm(tied)
        config = {**psc.LM_CONFIG, "pipeline": {"stages": stages, "schedule": schedule}}
        engine, *_ = shardwise.initialize(model=model, config=config, model_parameters=model.parameters())
        dp = engine.grid.get_data_parallel_id()
        losses = [float(engine.train_batch(iter(psc.lm_data(s, dp, 2)))) for s in range(steps)]
        out.append((losses, {n: p.detach().clone() for n, p in engine.module.named_parameters()}))
    return out


class StallOnRank1(pc.Block):
    """Rank 1 only: its first forward stalls (a hung stage, alive) until rank 0 has written its line, or 30 s."""

    calls = 0

    def forward(self, x):
        import os
        import time

        StallOnRank1.calls += 1
        if int(os.environ["RANK"]) == 1 and StallOnRank1.calls == 1:
            end = time.monotonic() + 30
            while time.monotonic() < end and not os.path.exists(os.environ["STALL_FLAG"]):
                time.sleep(0.05)
        return super().forward(x)


def stalled_stage(folder: str) -> tuple[float, str]:
    """PP 2; stage 1 stalls in its first forward. Each rank's (seconds in train_batch, the line it raised).
    Rank 0 writes its line to ``folder/rank0.txt`` once raised, which ends rank 1's stall."""
    import os
    import time

    import shardwise
    from shardwise.pipeline import LayerSpec, PipelineModule

    os.environ["STALL_FLAG"] = f"{folder}/rank0.txt"
    model = PipelineModule([LayerSpec(pc.Block), LayerSpec(pc.Block), LayerSpec(StallOnRank1),
                            LayerSpec(pc.Head, pc.WIDTH, pc.OUT)], num_stages=2, loss_fn=F.mse_loss,
                           partition_method="uniform")
    engine, *_ = shardwise.initialize(model=model, config=pc.CONFIG)
    start = time.monotonic()
    try:
        engine.train_batch(pc.batches(0, 0, pc.CONFIG))
        line = "none"
    except Exception as e:  # noqa: BLE001 - the line is what is checked
        line = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    if engine.stage_id == 0:
        with open(f"{folder}/rank0.tmp", "w") as f:
            f.write(line)
        os.replace(f"{folder}/rank0.tmp", f"{folder}/rank0.txt")
    return seconds, line
