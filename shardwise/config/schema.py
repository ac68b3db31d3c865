"""The DeepSpeed JSON config as pydantic models: every section and key, with its default.

`shardwise.config` reads, normalizes and resolves a config into these models.
"""

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictInt

from shardwise.errors import OneLineError
from shardwise.monitor.settings import (
    CometConfig,
    CommsLoggerConfig,
    CSVConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)

AUTO = "auto"
FreeDict = dict[str, Any]


def _strict_bool(value: Any) -> Any:
    """JSON true/false, or the integers 1/0 (unambiguous; DeepSpeed's own tests write them). Never a
    string: "false" must not read as true (DeepSpeed's top level would)."""
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise ValueError(f"expected true or false (a JSON boolean, or 1/0), got {type(value).__name__} {value!r}")


Bool = Annotated[bool, BeforeValidator(_strict_bool)]
# Sizes: a count of elements or samples; larger values are typos (2**40 samples per GPU), not configs.
MAX_BATCH = 2**24
MAX_ELEMENTS = 2**48
_Batch = Annotated[int, Field(gt=0, le=MAX_BATCH)]


class ConfigError(ValueError, OneLineError):
    """A user-facing config problem; the message names the dotted key path and the fix."""


@dataclass(frozen=True)
class SupportedFeatures:
    """Features this build implements: a config that uses any other one fails early, never silently."""

    stage3: bool = False
    tensor_parallel: bool = False
    offload_param: bool = False
    hybrid: bool = False  # zero_optimization.mics_shard_size: shard within k ranks, replicate across

    @classmethod
    def everything(cls) -> "SupportedFeatures":
        """What shardwise.engine.initialize (and the CLI's early config check) accept."""
        return cls(stage3=True, tensor_parallel=True, offload_param=True, hybrid=True)


class _Section(BaseModel):
    """Checked section: unknown keys are errors, because a typo must not silently become a default."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    def get(self, key: str, default: Any = None) -> Any:
        """A key read as from the JSON dict: DeepSpeed's ``engine.config`` is that dict, and the
        Trainer reads ``engine.config.get("zero_optimization", {}).get("stage")``."""
        return getattr(self, key, default) if key in type(self).model_fields else default

    def __getitem__(self, key: str) -> Any:
        """``config["zero_optimization"]["offload_optimizer"]["device"]``, as OpenRLHF's
        ``offload_deepspeed_states`` reads DeepSpeed's ``engine.config`` dict; KeyError as a dict's."""
        if key not in type(self).model_fields:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in type(self).model_fields


class FP16Config(_Section):
    enabled: Bool = False
    auto_cast: Bool = False
    loss_scale: float = Field(0.0, ge=0)  # 0 = dynamic loss scaling
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, gt=0)
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: Bool = False
    min_loss_scale: float = Field(1.0, gt=0)
    fp16_master_weights_and_grads: Bool = False  # fp16 master, fp32 optimizer states (zero/low_precision.py)


class BF16Config(_Section):
    enabled: Bool = False
    immediate_grad_update: Bool = True
    check_grad_overflow: Bool = False
    bf16_master_weights_and_grads: Bool = False  # bf16 master and gradients (zero/low_precision.py)
    bf16_optimizer_states: Bool = False  # and bf16 optimizer states


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
    pin_memory: Bool = False
    pipeline_read: Bool = False
    pipeline_write: Bool = False
    fast_init: Bool = False
    ratio: float = Field(1.0, ge=0, le=1)


class OffloadParamConfig(_Section):
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(le=MAX_ELEMENTS, default=100_000_000, gt=0)
    max_in_cpu: int = Field(le=MAX_ELEMENTS, default=1_000_000_000, ge=0)
    pin_memory: Bool = False


class ZeroConfig(_Section):
    stage: int = Field(0, ge=0, le=3)
    contiguous_gradients: Bool = True
    overlap_comm: Bool = False  # not set: True at stage 3, as DeepSpeed
    reduce_scatter: Bool = True
    reduce_bucket_size: int = Field(le=MAX_ELEMENTS, default=500_000_000, gt=0)
    use_multi_rank_bucket_allreduce: Bool = True
    allgather_partitions: Bool = True
    allgather_bucket_size: int = Field(le=MAX_ELEMENTS, default=500_000_000, gt=0)
    round_robin_gradients: Bool = False
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    sub_group_size: int = Field(le=MAX_ELEMENTS, default=1_000_000_000, gt=0)
    stage3_max_live_parameters: int = Field(le=MAX_ELEMENTS, default=1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(le=MAX_ELEMENTS, default=1_000_000_000, ge=0)
    stage3_prefetch_bucket_size: int = Field(le=MAX_ELEMENTS, default=50_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(le=MAX_ELEMENTS, default=100_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: Bool = False
    stage3_module_granularity_threshold: int = Field(le=MAX_ELEMENTS, default=0, ge=0)
    elastic_checkpoint: Bool = False
    ignore_unused_parameters: Bool = True
    legacy_stage1: Bool = False
    load_from_fp32_weights: Bool = True
    mics_shard_size: int = -1
    zero_hpz_partition_size: int = Field(1, ge=1)
    zero_quantized_weights: Bool = False
    zero_quantized_gradients: Bool = False
    memory_efficient_linear: Bool = True


class TPSizeConfig(_Section):
    """The `tp` sub-dict of DeepSpeed inference-style configs; only the size matters for training."""

    enabled: Bool = True
    tp_size: int = Field(1, ge=1, le=2**16)


class TensorParallelConfig(_Section):
    autotp_size: int = Field(1, ge=0, le=2**16)  # 0 (DeepSpeed's "off") reads as 1; resolved to the effective size
    tp_overlap_comm: Bool = False
    partition_config: FreeDict | None = None
    tp: TPSizeConfig = Field(default_factory=TPSizeConfig)


class ExpertParallelConfig(_Section):
    """DeepSpeed AutoEP's keys, served by shardwise.moe (docs/moe.md)."""

    enabled: Bool = False
    autoep_size: int = Field(1, ge=1, le=2**16)
    preset_model: str | None = None


MAX_TIMEOUT_S = 7 * 86400


def check_timeout(value: Any) -> float | None:
    """shardwise.timeout_s: a plain number of seconds in [1, one week] (not a string, not a bool)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value <= MAX_TIMEOUT_S:
        raise ValueError(f"must be a number of seconds from 1 to {MAX_TIMEOUT_S} (one week), got {value!r}")
    return float(value)


class ShardwiseSection(_Section):
    """The `shardwise` section: settings DeepSpeed has no key for (DeepSpeed ignores this section)."""

    # collective timeout (init_distributed(timeout=)); None: SHARDWISE_TIMEOUT, else 600 s
    timeout_s: Annotated[float | None, BeforeValidator(check_timeout)] = None
    # integer width of zero_optimization.zero_quantized_gradients (ZeRO++ qgZ): int8 or int4
    quantized_gradient_bits: Literal[8, 4] = 8
    # fp32/bf16 steps with a non-finite gradient norm skipped before training stops (engine/nonfinite.py)
    max_nonfinite_steps: StrictInt = Field(0, ge=0, le=10**9)
    # the accelerator's peak in TFLOPS for the FLOPs profiler's MFU (None: shardwise/monitor/flops.py's table)
    peak_tflops: float | None = Field(None, gt=0)
    # ALST's activation-checkpoint offload: checkpoint inputs held in host memory (sequence_parallel/offload.py)
    offload_activation_checkpoints: Bool = False
    # sequence-parallel attention: Ulysses when it can split the heads, else ring ("auto"), or one of them
    sequence_parallel_attention: Literal["auto", "ulysses", "ring"] = "auto"
    # how a bf16/fp16 master takes its fp32 update (zero/low_precision.py, docs/precision.md)
    master_update: Literal["nearest", "kahan", "stochastic"] = "kahan"
    # asynchronous checkpoints (checkpoint/async_save.py): None follows DeepSpeed's switches
    # (checkpoint.writer.decoupled, datastates_ckpt); true/false overrides them
    async_checkpoint: Bool | None = None
    # an asynchronous save's host staging buffer kept for the next save (checkpoint/staging.py)
    keep_checkpoint_buffer: Bool = False


class ShardwiseConfig(_Section):
    """The resolved config; build it with `load_config`, which completes the batch sizes and "auto"."""

    train_batch_size: _Batch | None = None  # always set after load_config
    train_micro_batch_size_per_gpu: _Batch | None = None  # always set after load_config
    gradient_accumulation_steps: _Batch | None = None  # always set after load_config
    gradient_clipping: float = Field(0.0, ge=0)  # 0 = off
    # None or 0 = never; accelerate writes float("inf") (DeepSpeed's "never" too)
    steps_per_print: Annotated[int | None, BeforeValidator(lambda v: None if v == float("inf") else v)] = \
        Field(10, ge=0)
    wall_clock_breakdown: Bool = False
    prescale_gradients: Bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0)
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    seed: int | None = None
    dump_state: Bool = False
    zero_allow_untested_optimizer: Bool = False
    zero_force_ds_cpu_optimizer: Bool = True
    memory_breakdown: Bool = False
    dataloader_drop_last: Bool = False
    shardwise: ShardwiseSection = Field(default_factory=ShardwiseSection)
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    sequence_parallel_size: int = Field(1, ge=1, le=2**16)  # Ulysses SP: shardwise/sequence_parallel/
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    # Free-form sections: kept as given, not checked deeply (we do not interpret them, or only a few keys).
    activation_checkpointing: FreeDict = Field(default_factory=dict)
    data_types: FreeDict = Field(default_factory=dict)
    checkpoint: FreeDict = Field(default_factory=dict)
    pipeline: FreeDict = Field(default_factory=dict)  # read from the raw config by shardwise/pipeline/ (keys.py)
    datastates_ckpt: FreeDict | Bool | None = None  # DataStates' switch: asynchronous saves (any value but false)
    # monitoring and profiling: checked sections, honoured by shardwise/monitor/
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    aio: FreeDict = Field(default_factory=dict)

    _world_size: int = PrivateAttr(1)
    _ignored: list[str] = PrivateAttr(default_factory=list)  # notices for keys accepted and ignored

    @property
    def ignored_keys(self) -> list[str]:
        """The notices load_config logged (rank 0) for keys that shardwise accepts and ignores."""
        return list(self._ignored)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def tp_size(self) -> int:
        return max(1, self.tensor_parallel.autotp_size)

    @property
    def dp_world(self) -> int:
        """Data-parallel replicas: the ranks of one SP group read the same samples."""
        return self._world_size // (self.tp_size * self.sequence_parallel_size)

    @property
    def zero_stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def precision(self) -> Literal["fp32", "bf16", "fp16"]:
        return "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"

    @property
    def compute_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.precision]

    @property
    def grad_accum_dtype(self) -> torch.dtype | None:
        """fp32 when ``data_types.grad_accum_dtype`` asks for it with bf16/fp16 compute, else None (the
        compute dtype; config/keys.py (grad_accum_ok) refuses at load what the engine cannot honour)."""
        from shardwise.config.keys import dtype_name

        fp32 = dtype_name(self.data_types.get("grad_accum_dtype")) == "fp32"
        return torch.float32 if fp32 and self.precision != "fp32" else None

    @property
    def master_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(master dtype, optimizer-state dtype): fp32 and fp32 unless DeepSpeed's low-precision master keys
        ask for the compute dtype (``bf16.bf16_master_weights_and_grads`` [+ ``bf16_optimizer_states``],
        ``fp16.fp16_master_weights_and_grads``: fp16 keeps fp32 states, as DeepSpeed does)."""
        if self.bf16.enabled and self.bf16.bf16_master_weights_and_grads:
            return torch.bfloat16, torch.bfloat16 if self.bf16.bf16_optimizer_states else torch.float32
        if self.fp16.enabled and self.fp16.fp16_master_weights_and_grads:
            return torch.float16, torch.float32
        return torch.float32, torch.float32


# -- per-type parameter models (validated after the type is known) --------------------------------------
_Beta = Annotated[float, Field(ge=0, lt=1)]


class _AdamParams(_Section):
    lr: float = Field(1e-3, ge=0)
    betas: tuple[_Beta, _Beta] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    bias_correction: Bool = True
    amsgrad: Bool = False
    torch_adam: Bool = False
    adam_w_mode: Bool = True  # DeepSpeed's "Adam" decouples weight decay unless this is false
    fused: Bool | None = None


class _AdamWParams(_AdamParams):
    weight_decay: float = Field(0.01, ge=0)


class _SGDParams(_Section):
    lr: float = Field(1e-3, ge=0)
    momentum: float = Field(0.0, ge=0)
    dampening: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    nesterov: Bool = False


class _LambParams(_Section):
    """DeepSpeed's FusedLamb keys and defaults (ds_optimizers.Lamb)."""

    lr: float = Field(1e-3, ge=0)
    bias_correction: Bool = True
    betas: tuple[_Beta, _Beta] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    eps_inside_sqrt: Bool = False
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(0.0, ge=0)
    max_coeff: float = Field(10.0, gt=0)
    min_coeff: float = Field(0.01, ge=0)
    amsgrad: Bool = False


class _MuonParams(_Section):
    """The keys DeepSpeed's engine routes to MuonWithAuxAdam's groups (None: that group's default)."""

    lr: float | None = Field(None, ge=0)
    muon_lr: float | None = Field(None, ge=0)
    adam_lr: float | None = Field(None, ge=0)
    momentum: float | None = Field(None, ge=0, lt=1)
    betas: tuple[_Beta, _Beta] | None = None
    eps: float | None = Field(None, gt=0)
    weight_decay: float | None = Field(None, ge=0)
    ns_method: Literal["gram", "standard"] | None = None


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


OPTIMIZERS: dict[str, tuple[str, type[BaseModel]]] = {
    "adam": ("Adam", _AdamParams), "adamw": ("AdamW", _AdamWParams), "sgd": ("SGD", _SGDParams),
    "lamb": ("Lamb", _LambParams), "muon": ("Muon", _MuonParams)}
DS_ONLY_OPTIMIZERS = {"onebitadam", "zerooneadam", "onebitlamb", "adagrad", "lion", "muadam",
                      "muadamw", "musgd", "cpuadam", "fusedadam"}
SCHEDULERS: dict[str, type[BaseModel]] = {"WarmupLR": _WarmupLRParams, "WarmupDecayLR": _WarmupDecayLRParams,
                                            "WarmupCosineLR": _WarmupCosineLRParams}
# DeepSpeed accepts these short names for the stage3_* keys (populate_by_name); the long name is ours.
ZERO_ALIASES = {name.removeprefix("stage3_"): name for name in ZeroConfig.model_fields
                 if name.startswith("stage3_")}
