"""DeepSpeed-compatible JSON config: pydantic models, "auto" resolution and the batch rule.

Configs written for DeepSpeed (or for the HF Trainer, full of "auto") must load unchanged, and every
problem raises `ConfigError` naming the dotted key path, so users fix their file without reading code.
Flow: read -> normalize (aliases, deprecations, "auto") -> validate (pydantic) -> resolve (cross-key rules).
"""

import copy
import difflib
import json
import os
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

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


# -- error formatting -----------------------------------------------------------------------------------
def _suggest(key: str, options: Iterable[str]) -> str:
    """Nearest valid name (case-insensitive), or the whole list when nothing is close."""
    by_lower = {o.lower(): o for o in sorted(options)}
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"did you mean '{by_lower[close[0]]}'?" if close else "valid keys: " + ", ".join(by_lower.values())


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section model that a pydantic error location points into (for suggestions)."""
    model = root
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        options = (field.annotation, *get_args(field.annotation)) if field else ()
        sub = next((a for a in options if get_origin(a) is None and isinstance(a, type)
                    and issubclass(a, BaseModel)), None)
        if not sub:
            return None
        model = sub
    return model


def _validate(model: type[_M], data: Any, prefix: str = "") -> _M:
    """model.model_validate, with every problem rewritten as 'dotted.path: what is wrong; fix'."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            path = ".".join(str(p) for p in (*([prefix] if prefix else []), *loc)) or "<config>"
            if err["type"] == "extra_forbidden":
                parent = _model_at(model, loc[:-1])
                hint = _suggest(str(loc[-1]), parent.model_fields) if parent else "remove it"
                lines.append(f"{path}: unknown key; {hint}")
            elif err["type"] == "missing":
                lines.append(f"{path}: required key is missing")
            else:
                lines.append(f"{path}: {err['msg']} (got {repr(err['input'])[:60]})")
        if len(lines) == 1:
            raise ConfigError(lines[0]) from None
        raise ConfigError(f"{len(lines)} problems in the config:\n  " + "\n  ".join(lines)) from None


def _deprecated(old: str, new: str) -> None:
    """FutureWarning (shown to end users), attributed to the first caller outside this module."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame, level = frame.f_back, level + 1
    warnings.warn(f"config key '{old}' is deprecated; use '{new}' instead", FutureWarning, stacklevel=level)


# -- normalize: aliases, deprecations and "auto", on the raw dict --------------------------------------
def _rename(section: dict[str, Any], old: str, new: str, where: str, *, deprecated: bool) -> None:
    if old not in section:
        return
    value = section.pop(old)
    if deprecated:
        _deprecated(f"{where}{old}", f"{where}{new}")
    if new in section and section[new] != value:
        raise ConfigError(f"{where}{old} and {where}{new} are both set, differently; keep only '{new}'")
    section[new] = value


def _normalize_zero(zero: dict[str, Any], hidden: int | None) -> None:
    where = "zero_optimization."
    for old, new in _ZERO_ALIASES.items():
        _rename(zero, old, new, where, deprecated=False)
    _rename(zero, "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
            where, deprecated=True)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old in zero:
            _deprecated(where + old, f'{where}{new}: {{"device": "cpu"}}')
            if zero.pop(old):
                if zero.get(new):
                    raise ConfigError(f"{where}{old} and {where}{new} are both set; keep only '{new}'")
                zero[new] = {"device": "cpu"}
    if "cpu_offload_use_pin_memory" in zero:
        _deprecated(where + "cpu_offload_use_pin_memory", where + "offload_optimizer.pin_memory")
        if zero.pop("cpu_offload_use_pin_memory"):
            for sub in (zero.get("offload_optimizer"), zero.get("offload_param")):
                if isinstance(sub, dict) and sub.get("device") == "cpu":
                    sub.setdefault("pin_memory", True)
    # "auto" as the HF Trainer resolves it: bucket sizes from the model's hidden size, else the default.
    by_hidden = {} if hidden is None else {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden}
    for key, value in list(zero.items()):
        if value is None and key.startswith("offload_"):
            del zero[key]
        elif isinstance(value, dict) and key.startswith("offload_"):
            zero[key] = {k: v for k, v in value.items() if v != AUTO}
        elif value != AUTO:
            continue
        elif key == "stage":
            raise ConfigError(f"{where}stage: 'auto' cannot be resolved; set 0, 1, 2 or 3")
        elif key == "overlap_comm":
            zero[key] = True
        elif key in by_hidden:
            zero[key] = by_hidden[key]
        else:
            del zero[key]  # the default applies


def _normalize(raw: dict[str, Any], hidden: int | None) -> dict[str, Any]:
    _rename(raw, "bfloat16", "bf16", "", deprecated=True)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if raw.get(key) == AUTO:
            del raw[key]  # completed by the batch rule
    if raw.get("gradient_clipping") == AUTO:
        raw["gradient_clipping"] = 1.0  # HF's max_grad_norm default
    for key in ("fp16", "bf16"):
        if isinstance(raw.get(key), dict) and raw[key].get("enabled") == AUTO:
            raw[key]["enabled"] = False
    if isinstance(raw.get("zero_optimization"), dict):
        _normalize_zero(raw["zero_optimization"], hidden)
    return raw


# -- resolve: rules across keys, after validation -------------------------------------------------------
def _resolve_tp(cfg: ShardwiseConfig, tp_size_hint: int | None) -> None:
    tp = cfg.tensor_parallel
    sources = []
    if "autotp_size" in tp.model_fields_set and tp.autotp_size > 0:
        sources.append(("tensor_parallel.autotp_size", tp.autotp_size))
    if "tp" in tp.model_fields_set and "tp_size" in tp.tp.model_fields_set:
        sources.append(("tensor_parallel.tp.tp_size", tp.tp.tp_size))
    if tp_size_hint is not None:
        sources.append(("tp_size_hint", tp_size_hint))
    if len({size for _, size in sources}) > 1:
        given = ", ".join(f"{name}={size}" for name, size in sources)
        raise ConfigError(f"tensor_parallel.autotp_size: conflicting tensor-parallel sizes ({given}); "
                          "make them equal")
    tp.autotp_size = sources[0][1] if sources else 1


def _resolve_optimizer(cfg: ShardwiseConfig) -> None:
    opt = cfg.optimizer
    if opt is None:
        return
    name = opt.type.lower()
    if name not in _OPTIMIZERS:
        torch_names = {n.lower() for n in dir(torch.optim) if n[:1].isupper()}
        if name in _DS_ONLY_OPTIMIZERS | torch_names:
            raise ConfigError(f"optimizer.type: '{opt.type}' is not supported in shardwise; use Adam, AdamW "
                              "or SGD, or pass a client optimizer to shardwise.initialize(optimizer=...)")
        raise ConfigError(f"optimizer.type: unknown optimizer '{opt.type}'; "
                          + _suggest(opt.type, [n for n, _ in _OPTIMIZERS.values()]))
    opt.type, model = _OPTIMIZERS[name]
    params = {k: v for k, v in opt.params.items() if v != AUTO}  # "auto" = the default for this type
    opt.params = _validate(model, params, "optimizer.params").model_dump()


def _resolve_scheduler(cfg: ShardwiseConfig) -> None:
    sch = cfg.scheduler
    if sch is None:
        return
    model = _SCHEDULERS.get(sch.type)
    if model is None:
        if sch.type in ("LRRangeTest", "OneCycle"):
            raise ConfigError(f"scheduler.type: '{sch.type}' is not supported in shardwise; use one of "
                              f"{', '.join(_SCHEDULERS)}, or pass lr_scheduler= to shardwise.initialize")
        hint = _suggest(sch.type, _SCHEDULERS)
        raise ConfigError(f"scheduler.type: unknown scheduler '{sch.type}'; {hint}")
    params = dict(sch.params)
    if "total_num_steps" in model.model_fields and params.get("total_num_steps", AUTO) == AUTO:
        raise ConfigError(f"scheduler.params.total_num_steps: {sch.type} needs the total number of optimizer "
                          "steps and 'auto' cannot be resolved here; pass an integer, or use WarmupLR")
    if params.get("warmup_max_lr") == AUTO:
        params["warmup_max_lr"] = cfg.optimizer.params["lr"] if cfg.optimizer else 1e-3
    params = {k: v for k, v in params.items() if v != AUTO}
    sch.params = _validate(model, params, "scheduler.params").model_dump()


def _check_supported(cfg: ShardwiseConfig, supported: SupportedFeatures) -> None:
    """The one place that knows which features exist; flags in SupportedFeatures turn them on."""
    z, zo = cfg.zero_optimization, "zero_optimization."
    uses = [  # (flag in SupportedFeatures, None = not implemented at all), used?, what, key path, value
        ("stage3", z.stage == 3, "ZeRO stage 3", zo + "stage", z.stage),
        ("tensor_parallel", cfg.tp_size > 1, "Tensor parallelism", "tensor_parallel.autotp_size",
         cfg.tp_size),
        ("zeropp", z.zero_quantized_weights, "ZeRO++ quantized weights", zo + "zero_quantized_weights", True),
        ("zeropp", z.zero_quantized_gradients, "ZeRO++ quantized gradients", zo + "zero_quantized_gradients",
         True),
        ("zeropp", z.zero_hpz_partition_size > 1, "ZeRO++ hierarchical partitioning",
         zo + "zero_hpz_partition_size", z.zero_hpz_partition_size),
        ("offload_param", z.offload_param.device != "none", "Parameter offload", zo + "offload_param.device",
         z.offload_param.device),
        (None, z.offload_param.device == "nvme", "NVMe offload", zo + "offload_param.device", "nvme"),
        (None, z.offload_optimizer.device == "nvme", "NVMe offload", zo + "offload_optimizer.device", "nvme"),
        (None, z.mics_shard_size > 0, "MiCS", zo + "mics_shard_size", z.mics_shard_size),
    ]
    problems = [f"{what} is not supported yet in shardwise ({path} = {value!r}); remove the key or use its "
                "default" for flag, used, what, path, value in uses
                if used and (flag is None or not getattr(supported, flag))]
    if problems:
        raise ConfigError("; ".join(dict.fromkeys(problems)))


def _exact_div(total: int, by: int, what: str) -> int:
    if total % by:
        raise ConfigError(f"train_batch_size: {total} is not divisible by {what} = {by}; "
                          f"set train_batch_size to a multiple of {by} or change the factors")
    return total // by


def _resolve_batch(cfg: ShardwiseConfig) -> None:
    """train_batch_size = micro × accumulation × dp_world: check it, or complete the missing ones."""
    dp = cfg.dp_world
    tbs, mbs, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * dp:
            fixes = [f"set train_batch_size to {mbs * gas * dp}"]
            if tbs % (mbs * dp) == 0:
                fixes.append(f"set gradient_accumulation_steps to {tbs // (mbs * dp)}")
            else:
                fixes.append("change train_micro_batch_size_per_gpu or gradient_accumulation_steps to match")
            fixes.append('set one of the three to "auto" (or remove it) to have it computed')
            raise ConfigError(
                f"train_batch_size: {tbs} != train_micro_batch_size_per_gpu ({mbs}) × "
                f"gradient_accumulation_steps ({gas}) × dp_world ({dp}) = {mbs * gas * dp}; fix: "
                + "; or ".join(fixes))
    elif tbs is not None and mbs is not None:
        gas = _exact_div(tbs, mbs * dp, f"train_micro_batch_size_per_gpu ({mbs}) × dp_world ({dp})")
    elif tbs is not None and gas is not None:
        mbs = _exact_div(tbs, gas * dp, f"gradient_accumulation_steps ({gas}) × dp_world ({dp})")
    elif tbs is not None:
        gas, mbs = 1, _exact_div(tbs, dp, f"dp_world ({dp})")
    else:
        mbs, gas = mbs or 1, gas or 1
        tbs = mbs * gas * dp
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = tbs, mbs, gas


def _read(config: str | os.PathLike[str] | dict[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)  # never modify the caller's dict
    if not isinstance(config, str | os.PathLike):
        raise ConfigError(f"config must be a path to a JSON file or a dict, not {type(config).__name__}")
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass the path of a DeepSpeed JSON config")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not valid JSON: {exc.msg} at line {exc.lineno}, "
                          f"column {exc.colno}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}': the top level must be a JSON object, "
                          f"not {type(data).__name__}")
    return data


def load_config(config: str | os.PathLike[str] | dict[str, Any] | None, *, world_size: int = 1,
                tp_size_hint: int | None = None, hidden_size: int | None = None,
                supported: SupportedFeatures | None = None) -> ShardwiseConfig:
    """Load a DeepSpeed JSON config (path or dict) and resolve "auto", aliases and the batch rule.

    world_size: total ranks; hidden_size: the model's, for the "auto" bucket sizes (None: defaults);
    tp_size_hint: a tensor-parallel size chosen outside the config, which must agree with it.
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    raw = _normalize(_read(config), hidden_size)
    cfg = _validate(ShardwiseConfig, raw)
    cfg._world_size = world_size
    _resolve_tp(cfg, tp_size_hint)
    _check_supported(cfg, supported or SupportedFeatures())
    if cfg.tp_size < 1 or world_size % cfg.tp_size:
        raise ConfigError(f"tensor_parallel.autotp_size: {cfg.tp_size} does not divide the world size "
                          f"{world_size}; choose a divisor of {world_size}")
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one of them")
    z = cfg.zero_optimization
    if "overlap_comm" not in z.model_fields_set:
        z.overlap_comm = z.stage == 3  # DeepSpeed's default depends on the stage
    if z.offload_optimizer.device != "none" and z.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer.device: optimizer offload needs "
                          "zero_optimization.stage 1, 2 or 3; raise the stage or set device to 'none'")
    _resolve_optimizer(cfg)
    _resolve_scheduler(cfg)
    _resolve_batch(cfg)
    return cfg
