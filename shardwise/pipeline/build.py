"""``initialize(model=PipelineModule, ...)``: the stage's engine, its groups and what is not served.

The engine's groups come from the pipeline grid (``engine.grid``): ZeRO shards over the stage's
data-parallel group and the batch rule counts data-parallel ranks only (DeepSpeed's arithmetic:
``train_batch_size = micro_batch * gradient_accumulation_steps * data_parallel_size``, the
micro-batches of a batch being the accumulation steps). The config's ``pipeline.schedule``
(``1f1b``, the default, ``gpipe``, or ``interleaved_1f1b`` for a ``PipelineModule(virtual_stages=v)``)
picks the schedule; DeepSpeed's other ``pipeline`` keys
(``stages``, ``partition``, ``seed_layers``, ``activation_checkpoint_interval``) are read by it from
the ``PipelineModule``'s own arguments, as here, and ``pipe_partitioned`` / ``grad_partitioned``
(how DeepSpeed cuts the activations sent between stages over the model-parallel ranks) change no number:
here each model-parallel rank sends its whole activations to its peer of the next stage.

Composition (docs/pipeline.md, "Composition"): the stage's groups are the run layout's, cut from the one
rank grid with the stages outermost (``RunLayout.of(..., pp=stages)``): tensor parallelism over the
topology's ``model`` axis (``PipeModelDataParallelTopology``; the layers are split by the script over
``grid.tp_comm()``, as DeepSpeed's are over Megatron's groups, and marked as ``mpu`` models are), and
sequence parallelism over ``sequence_parallel_size`` ranks of each stage's data axis (the layers exchange
over ``grid.sp_comm()``; each SP rank reads its own sequence shard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shardwise.comm import CommStats, make_comm
from shardwise.config import ShardwiseConfig, SupportedFeatures, load_config, read_config
from shardwise.engine.compat import UsageError
from shardwise.engine.mpu import mark_tp_params
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
    z, grid, experts = cfg.zero_optimization, model.mpu(), getattr(model, "expert_parallel", None)
    if cfg.tp_size != grid.model_parallel_size:
        raise UsageError(f"tensor_parallel.autotp_size {cfg.tp_size} with a PipelineModule whose topology has "
                         f"model-parallel size {grid.model_parallel_size}: give PipelineModule(topology="
                         f"PipeModelDataParallelTopology(num_pp, num_mp={cfg.tp_size}, num_dp)) and layers split over "
                         "its grid's tp_comm() (automatic tensor parallelism slices Hugging Face models only)")
    unserved = {
        "fp16.enabled (each stage would scale its loss on its own; use bf16)": cfg.fp16.enabled,
        f"a topology ordered {', '.join(grid.topology().axes)} (not pipe, data[, model])": (
            not grid.on_layout and cfg.sequence_parallel_size > 1),
        "sequence_parallel_size > 1 beside a model-parallel size > 1": (
            cfg.sequence_parallel_size > 1 and cfg.tp_size > 1),
        "expert_parallel.enabled beside a PipelineModule of the script's own layers (served for a Hugging Face "
        "MoE model split by pipeline.stages)": cfg.expert_parallel.enabled and experts is None,
        "zero_optimization.mics_shard_size": z.mics_shard_size > 0,
        "zero_optimization.zero_hpz_partition_size > 1": z.zero_hpz_partition_size > 1,
    }
    for what, on in unserved.items():
        if on:
            raise UsageError(f"{what} with pipeline parallelism (a PipelineModule) is not served by shardwise; "
                             "drop it or train without the PipelineModule")


def _stage_layout(grid: Any, cfg: ShardwiseConfig, model: PipelineModule) -> RunLayout:
    """The stage engine's groups: the run layout's, cut inside each stage (stages outermost), the grid's
    model-parallel and sequence-parallel comms counting into its ``comm_stats()``; the layers' split
    parameters marked. A topology in another order: its own data-parallel group, no TP or SP."""
    if not grid.on_layout:
        stats = CommStats()
        dp = make_comm(grid.get_data_parallel_group(), stats, size=grid.data_parallel_size)
        solo = make_comm("solo", stats)
        return RunLayout(Mesh(dp=dp, tp=solo, replicate=solo, dp_full=dp, stats=stats), None, None, stats)
    sp = cfg.sequence_parallel_size
    layout = RunLayout.of(tp=grid.model_parallel_size, sp=sp, pp=grid.pipe_parallel_size)
    for comm in (grid.mesh.tp, *((layout.sequence.sp, layout.sequence.data) if sp > 1 else ())):
        comm.stats = layout.stats  # the layers' own collectives count where the engine's do
    grid.sequence = layout.sequence
    layout.sequence = None  # the layers exchange over it themselves: no attention of the engine's to patch
    experts = getattr(model, "expert_parallel", None)  # a Hugging Face MoE model split over experts (entry.py)
    if experts is not None:
        layout.adopt_experts(experts.mesh)
    if layout.tp > 1 and not any(getattr(p, "_tp_spec", None) is not None for p in model.parameters()) \
            and mark_tp_params(model, layout.mesh.tp) == 0:
        raise UsageError(f"PipelineModule: model-parallel size {layout.tp} but no parameter of stage "
                         f"{grid.get_stage_id()} is marked as split; mark them (p.tensor_model_parallel = True, "
                         "p.partition_dim = d) or build them with shardwise.tensor_parallel's layers")
    return layout


def build_pipeline_engine(model: PipelineModule, config: Any, *, optimizer: Any = None, model_parameters: Any = None,
                          training_data: Dataset | None = None, lr_scheduler: Any = None,
                          collate_fn: Callable | None = None) -> tuple[PipelineEngine, Any, Any, Any]:
    """``(engine, optimizer, dataloader, lr_scheduler)`` for this rank's stage of ``model``."""
    grid = model.mpu()
    schedule = str((read_config(config).get("pipeline") or {}).get("schedule", "1f1b")).lower()
    mp = grid.model_parallel_size  # the stage's ranks are data x model: the batch rule divides by TP and SP
    cfg = load_config(config, world_size=grid.data_parallel_size * mp, tp_size_hint=mp if mp > 1 else None,
                      supported=SupportedFeatures(stage3=True, offload_param=True, tensor_parallel=True))
    _refuse(cfg, schedule, model)
    layout = _stage_layout(grid, cfg, model)
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
