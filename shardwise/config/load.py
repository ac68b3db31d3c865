"""DeepSpeed-compatible JSON config: pydantic models, "auto" resolution and the batch rule.

Configs written for DeepSpeed (or for the HF Trainer, full of "auto") must load unchanged, and every
problem raises `ConfigError` naming the dotted key path, so users fix their file without reading code.
Flow: read -> normalize (aliases, deprecations, "auto") -> validate (pydantic) -> resolve (cross-key rules).
"""

import os
import sys
import warnings
from typing import Any, TypeVar, get_args, get_origin

import torch
from pydantic import BaseModel, ValidationError

from shardwise.config.combinations import check_combinations
from shardwise.config.dotted import settle_dotted, take_dotted, warn_dotted
from shardwise.config.keys import children
from shardwise.config.read import read_config, timeout_of  # noqa: F401 (re-exported)
from shardwise.config.schema import (  # noqa: F401 (re-exported)
    AUTO,
    DS_ONLY_OPTIMIZERS,
    OPTIMIZERS,
    SCHEDULERS,
    ZERO_ALIASES,
    BF16Config,
    ConfigError,
    FP16Config,
    FreeDict,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    ShardwiseConfig,
    SupportedFeatures,
    TensorParallelConfig,
    TPSizeConfig,
    ZeroConfig,
)
from shardwise.config.triage import announce, raise_problems, triage
from shardwise.config.triage import suggest as _suggest

SectionModel = TypeVar("SectionModel", bound=BaseModel)  # the section a _validate call returns


# -- error formatting -----------------------------------------------------------------------------------
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


def _validate(model: type[SectionModel], data: Any, prefix: str = "", earlier: list[str] | None = None) -> SectionModel:
    """model.model_validate, with every problem rewritten as 'dotted.path: what is wrong; fix'.

    `earlier`: problems found before validation (refused or unknown keys), reported together.
    """
    lines, result = list(earlier or []), None
    try:
        result = model.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            loc = tuple(err["loc"])
            path = ".".join(str(p) for p in (*([prefix] if prefix else []), *loc)) or "<config>"
            if err["type"] == "extra_forbidden":
                parent = _model_at(model, loc[:-1])
                dotted = ".".join(str(p) for p in (*([prefix] if prefix else []), *loc[:-1]))
                options = set(parent.model_fields) | set(children(dotted)) if parent else set()
                hint = _suggest(str(loc[-1]), options) if options else "remove it"
                lines.append(f"{path}: unknown key; {hint}")
            elif err["type"] == "missing":
                lines.append(f"{path}: required key is missing")
            else:
                lines.append(f"{path}: {err['msg']} (got {repr(err['input'])[:60]})")
    raise_problems(lines)
    assert result is not None
    return result


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
        raise ConfigError(f"{where}{old}: {where}{old} and {where}{new} are both set, differently; keep only "
                          f"'{new}'")
    section[new] = value


def _normalize_zero(zero: dict[str, Any], hidden: int | None) -> None:
    where = "zero_optimization."
    for old, new in ZERO_ALIASES.items():
        _rename(zero, old, new, where, deprecated=False)
    _rename(zero, "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
            where, deprecated=True)
    for old in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"):
        if old in zero and zero[old] is not None and not isinstance(zero[old], bool):
            raise ConfigError(f"{where}{old}: expected true or false (a JSON boolean), got "
                              f"{type(zero[old]).__name__} {zero[old]!r}")
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
    if name not in OPTIMIZERS:
        torch_names = {n.lower() for n in dir(torch.optim) if n[:1].isupper()}
        if name in DS_ONLY_OPTIMIZERS | torch_names:
            raise ConfigError(f"optimizer.type: DeepSpeed feature optimizer {opt.type} (optimizer.type = "
                              f"'{opt.type}') is not implemented by shardwise; use Adam, AdamW or SGD, or pass a "
                              "client optimizer to shardwise.initialize(optimizer=...)")
        raise ConfigError(f"optimizer.type: unknown optimizer '{opt.type}'; "
                          + _suggest(opt.type, [n for n, _ in OPTIMIZERS.values()]))
    opt.type, model = OPTIMIZERS[name]
    params = {k: v for k, v in opt.params.items() if v != AUTO}  # "auto" = the default for this type
    opt.params = _validate(model, params, "optimizer.params").model_dump()


def _resolve_scheduler(cfg: ShardwiseConfig) -> None:
    sch = cfg.scheduler
    if sch is None:
        return
    model = SCHEDULERS.get(sch.type)
    if model is None:
        if sch.type in ("LRRangeTest", "OneCycle"):
            raise ConfigError(f"scheduler.type: DeepSpeed feature scheduler {sch.type} (scheduler.type = "
                              f"'{sch.type}') is not implemented by shardwise; use one of "
                              f"{', '.join(SCHEDULERS)}, or pass lr_scheduler= to shardwise.initialize")
        hint = _suggest(sch.type, SCHEDULERS)
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
        ("offload_param", z.offload_param.device != "none", "Parameter offload", zo + "offload_param.device",
         z.offload_param.device),
        ("hybrid", z.mics_shard_size > 0, "Hybrid sharding (MiCS)", zo + "mics_shard_size", z.mics_shard_size),
    ]
    problems = [f"{path}: DeepSpeed feature {what} ({path} = {value!r}) is not implemented by shardwise; "
                "remove the key or use its default" if flag is None else
                f"{path}: {what} ({path} = {value!r}) is not enabled in this load_config call; pass "
                f"supported=SupportedFeatures({flag}=True) (shardwise.initialize does)"
                for flag, used, what, path, value in uses if used and (flag is None or not getattr(supported, flag))]
    if z.zero_quantized_weights and z.stage != 3:  # ZeRO++ qwZ quantizes the stage-3 parameter gather
        problems.append(f"{zo}zero_quantized_weights: quantized weights need {zo}stage 3 (stage is {z.stage}: "
                        "parameters are not gathered); set stage 3 or remove the key")
    if z.zero_quantized_gradients and z.stage == 0:  # qgZ quantizes the gradient reduce-scatter
        problems.append(f"{zo}zero_quantized_gradients: quantized gradients need {zo}stage 1, 2 or 3 (stage 0 "
                        "all-reduces gradients); raise the stage or remove the key")
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


def load_config(config: str | os.PathLike[str] | dict[str, Any] | None, *, world_size: int = 1,
                tp_size_hint: int | None = None, hidden_size: int | None = None,
                supported: SupportedFeatures | None = None, mpu: Any = None,
                sp_from_mpu: bool = False) -> ShardwiseConfig:
    """Load a DeepSpeed JSON config (path or dict) and resolve "auto", aliases and the batch rule.

    world_size: total ranks; hidden_size: the model's, for the "auto" bucket sizes (None: defaults);
    tp_size_hint: a tensor-parallel size chosen outside the config, which must agree with it;
    mpu, sp_from_mpu: the groups ``initialize`` was given (``config/combinations.py``; world_size is then
    the mpu's data-parallel ranks).
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    raw = read_config(config)
    dotted = take_dotted(raw)  # "zero_optimization.x" at the top level (TRL): config/dotted.py
    raw = _normalize(raw, hidden_size)
    problems, ignored = triage(raw, ShardwiseConfig)  # refused and unknown keys
    cfg = _validate(ShardwiseConfig, raw, earlier=problems)
    cfg._ignored = ignored
    cfg._world_size = world_size
    _resolve_tp(cfg, tp_size_hint)
    _check_supported(cfg, supported or SupportedFeatures())
    check_combinations(cfg, world_size, mpu, sp_from_mpu)  # every combination of degrees, before the batch rule
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
    warn_dotted(settle_dotted(dotted, cfg))
    announce(ignored)
    return cfg
