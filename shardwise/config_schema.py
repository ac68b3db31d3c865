"""The DeepSpeed JSON config as pydantic models: every section and key, with its default.

`shardwise.config` reads, normalizes and resolves a config into these models.
"""

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

AUTO = "auto"
FreeDict = dict[str, Any]
_M = TypeVar("_M", bound=BaseModel)


class ConfigError(ValueError):
    """A user-facing config problem; the message names the dotted key path and the fix."""


@dataclass(frozen=True)
class SupportedFeatures:
    """Features this build implements: a config that uses any other one fails early, never silently."""

    stage3: bool = False
    tensor_parallel: bool = False
    zeropp: bool = False
    offload_param: bool = False
    hybrid: bool = False  # zero_optimization.mics_shard_size: shard within k ranks, replicate across


class _Section(BaseModel):
    """Checked section: unknown keys are errors, because a typo must not silently become a default."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class FP16Config(_Section):
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = Field(0.0, ge=0)  # 0 = dynamic loss scaling
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, gt=0)
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0)


class BF16Config(_Section):
    enabled: bool = False
    immediate_grad_update: bool = True
    check_grad_overflow: bool = False


class OptimizerConfig(_Section):
    """After load_config: `type` is "Adam" | "AdamW" | "SGD" and `params` holds every parameter."""

    type: str
    params: FreeDict = Field(default_factory=dict)


class SchedulerConfig(_Section):
    """After load_config: `params` holds every parameter of `type`, defaults and "auto" filled in."""

    type: str
    params: FreeDict = Field(default_factory=dict)


class OffloadOptimizerConfig(_Section):
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0, le=1)


class OffloadParamConfig(_Section):
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, gt=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = False


class ZeroConfig(_Section):
    stage: int = Field(0, ge=0, le=3)
    contiguous_gradients: bool = True
    overlap_comm: bool = False  # not set: True at stage 3, as DeepSpeed
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, gt=0)
    round_robin_gradients: bool = False
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    sub_group_size: int = Field(1_000_000_000, gt=0)
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_module_granularity_threshold: int = Field(0, ge=0)
    elastic_checkpoint: bool = False
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    load_from_fp32_weights: bool = True
    mics_shard_size: int = -1
    zero_hpz_partition_size: int = Field(1, ge=1)
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True


class TPSizeConfig(_Section):
    """The `tp` sub-dict of DeepSpeed inference-style configs; only the size matters for training."""

    enabled: bool = True
    tp_size: int = Field(1, ge=1)


class TensorParallelConfig(_Section):
    autotp_size: int = Field(1, ge=0)  # 0 (DeepSpeed's "off") reads as 1; resolved to the effective size
    tp_overlap_comm: bool = False
    partition_config: FreeDict | None = None
    tp: TPSizeConfig = Field(default_factory=TPSizeConfig)


class ShardwiseConfig(_Section):
    """The resolved config; build it with `load_config`, which completes the batch sizes and "auto"."""

    train_batch_size: int | None = Field(None, gt=0)  # always set after load_config
    train_micro_batch_size_per_gpu: int | None = Field(None, gt=0)  # always set after load_config
    gradient_accumulation_steps: int | None = Field(None, gt=0)  # always set after load_config
    gradient_clipping: float = Field(0.0, ge=0)  # 0 = off
    steps_per_print: int | None = Field(10, ge=0)  # None or 0 = never
    wall_clock_breakdown: bool = False
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0)
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    seed: int | None = None
    dump_state: bool = False
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    memory_breakdown: bool = False
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    # Free-form sections: kept as given, not checked deeply (we do not interpret them, or only a few keys).
    activation_checkpointing: FreeDict = Field(default_factory=dict)
    data_types: FreeDict = Field(default_factory=dict)
    checkpoint: FreeDict = Field(default_factory=dict)
    flops_profiler: FreeDict = Field(default_factory=dict)
    tensorboard: FreeDict = Field(default_factory=dict)
    wandb: FreeDict = Field(default_factory=dict)
    csv_monitor: FreeDict = Field(default_factory=dict)
    comms_logger: FreeDict = Field(default_factory=dict)
    aio: FreeDict = Field(default_factory=dict)

    _world_size: int = PrivateAttr(1)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def tp_size(self) -> int:
        return max(1, self.tensor_parallel.autotp_size)

    @property
    def dp_world(self) -> int:
        return self._world_size // self.tp_size

    @property
    def zero_stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def precision(self) -> Literal["fp32", "bf16", "fp16"]:
        return "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"

    @property
    def compute_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.precision]


# -- per-type parameter models (validated after the type is known) --------------------------------------
_Beta = Annotated[float, Field(ge=0, lt=1)]


class _AdamParams(_Section):
    lr: float = Field(1e-3, ge=0)
    betas: tuple[_Beta, _Beta] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    bias_correction: bool = True
    amsgrad: bool = False
    torch_adam: bool = False
    adam_w_mode: bool = True  # DeepSpeed's "Adam" decouples weight decay unless this is false
    fused: bool | None = None


class _AdamWParams(_AdamParams):
    weight_decay: float = Field(0.01, ge=0)


class _SGDParams(_Section):
    lr: float = Field(1e-3, ge=0)
    momentum: float = Field(0.0, ge=0)
    dampening: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    nesterov: bool = False


class _WarmupLRParams(_Section):
    warmup_min_lr: float = Field(0.0, ge=0)
    warmup_max_lr: float = Field(1e-3, ge=0)
    warmup_num_steps: int = Field(1000, ge=0)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = -1


class _WarmupDecayLRParams(_WarmupLRParams):
    total_num_steps: int = Field(gt=0)


class _WarmupCosineLRParams(_Section):
    total_num_steps: int = Field(gt=0)
    warmup_min_ratio: float = Field(0.0, ge=0)
    warmup_num_steps: int = Field(1000, ge=0)
    cos_min_ratio: float = Field(1e-4, ge=0)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = -1


_OPTIMIZERS: dict[str, tuple[str, type[BaseModel]]] = {
    "adam": ("Adam", _AdamParams), "adamw": ("AdamW", _AdamWParams), "sgd": ("SGD", _SGDParams)}
_DS_ONLY_OPTIMIZERS = {"lamb", "onebitadam", "zerooneadam", "onebitlamb", "adagrad", "lion", "muadam",
                       "muadamw", "musgd", "muon", "cpuadam", "fusedadam"}
_SCHEDULERS: dict[str, type[BaseModel]] = {"WarmupLR": _WarmupLRParams, "WarmupDecayLR": _WarmupDecayLRParams,
                                            "WarmupCosineLR": _WarmupCosineLRParams}
# DeepSpeed accepts these short names for the stage3_* keys (populate_by_name); the long name is ours.
_ZERO_ALIASES = {name.removeprefix("stage3_"): name for name in ZeroConfig.model_fields
                 if name.startswith("stage3_")}
