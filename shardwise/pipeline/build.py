"""``initialize(model=PipelineModule, ...)``: the stage's engine, its groups and what is not served.

The engine's groups come from the pipeline grid (``engine.grid``): ZeRO shards over the stage's
data-parallel group and the batch rule counts data-parallel ranks only (DeepSpeed's arithmetic:
``train_batch_size = micro_batch * gradient_accumulation_steps * data_parallel_size``, the
micro-batches of a batch being the accumulation steps). The config's ``pipeline.schedule``
(``1f1b``, the default, ``gpipe``, or ``interleaved_1f1b`` for a ``PipelineModule(virtual_stages=v)``)
picks the schedule; DeepSpeed's other ``pipeline`` keys
(``stages``, ``partition``, ``seed_layers``, ``activation_checkpoint_interval``) are read by it from
the ``PipelineModule``'s own arguments, as here, and ``pipe_partitioned`` / ``grad_partitioned``
only act with tensor parallelism, which is refused beside pipeline parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shardwise.comm import CommStats, make_comm
from shardwise.config import ShardwiseConfig, SupportedFeatures, load_config, read_config
from shardwise.engine.compat import UsageError
from shardwise.layout import Mesh, RunLayout
from shardwise.pipeline.engine import PipelineEngine
from shardwise.pipeline.module import PipelineModule
from shardwise.pipeline.schedule import SCHEDULES
from shardwise.utils import RepeatingLoader


def _refuse(cfg: ShardwiseConfig, schedule: str, model: PipelineModule) -> None:
    """One line for each combination pipeline parallelism does not serve yet."""
    if schedule not in SCHEDULES:
        raise UsageError(f"pipeline.schedule {schedule!r} is not served; use one of {', '.join(SCHEDULES)}")
    virtual = model.virtual_stages
    if (schedule == "interleaved_1f1b") != (virtual > 1):
        raise UsageError(f"pipeline.schedule {schedule!r} with PipelineModule(virtual_stages={virtual}): "
                         "interleaved_1f1b needs virtual_stages > 1, and virtual_stages > 1 needs interleaved_1f1b")
    if virtual > 1 and model.num_stages < 2:
        raise UsageError("pipeline.schedule interleaved_1f1b needs at least 2 stages (num_stages)")
    z = cfg.zero_optimization
    unserved = {
        "fp16.enabled (each stage would scale its loss on its own; use bf16)": cfg.fp16.enabled,
        "tensor_parallel.autotp_size > 1": cfg.tp_size > 1,
        "sequence_parallel_size > 1": cfg.sequence_parallel_size > 1,
        "expert_parallel.enabled": cfg.expert_parallel.enabled,
        "zero_optimization.mics_shard_size": z.mics_shard_size > 0,
        "zero_optimization.zero_hpz_partition_size > 1": z.zero_hpz_partition_size > 1,
    }
    for what, on in unserved.items():
        if on:
            raise UsageError(f"{what} with pipeline parallelism (a PipelineModule) is not served by shardwise; "
                             "drop it or train without the PipelineModule")


def build_pipeline_engine(model: PipelineModule, config: Any, *, optimizer: Any = None, model_parameters: Any = None,
                          training_data: Dataset | None = None, lr_scheduler: Any = None,
                          collate_fn: Callable | None = None) -> tuple[PipelineEngine, Any, Any, Any]:
    """``(engine, optimizer, dataloader, lr_scheduler)`` for this rank's stage of ``model``."""
    grid = model.mpu()
    schedule = str((read_config(config).get("pipeline") or {}).get("schedule", "1f1b")).lower()
    cfg = load_config(config, world_size=grid.data_parallel_size,
                      supported=SupportedFeatures(stage3=True, offload_param=True))
    _refuse(cfg, schedule, model)
    stats = CommStats()
    dp = make_comm(grid.get_data_parallel_group(), stats, size=grid.data_parallel_size)
    solo = make_comm("solo", stats)
    layout = RunLayout(Mesh(dp=dp, tp=solo, replicate=solo, dp_full=dp, stats=stats), None, None, stats)
    engine = PipelineEngine(model, cfg, schedule=schedule, model_parameters=model_parameters, optimizer=optimizer,
                            lr_scheduler=lr_scheduler, layout=layout)
    engine.training_dataloader = None
    if training_data is not None:  # DeepSpeed's: in order (no shuffle), this replica's part, repeated forever
        sampler = DistributedSampler(training_data, num_replicas=grid.data_parallel_size,
                                     rank=grid.get_data_parallel_id(), shuffle=False)
        engine.set_dataloader(RepeatingLoader(DataLoader(
            training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler, collate_fn=collate_fn,
            drop_last=cfg.dataloader_drop_last)))
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
