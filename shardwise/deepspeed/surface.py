"""Every DeepSpeed module path the facade serves, and the shardwise object behind each name.

One table, read by the import machinery (``finder.py``) and by the generated name list of
``docs/hf_trainer.md`` (``python -m shardwise.deepspeed names``), so the two cannot disagree.
The names are those transformers, accelerate, peft and trl import or read, plus the rest of
DeepSpeed's documented training API that shardwise implements (``docs/deepspeed_api.md``).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from shardwise import pipeline, utils, zero
from shardwise.comm import compat as comm_api
from shardwise.config.schema import ConfigError
from shardwise.deepspeed import accelerate_state, accelerator, names, ops, ulysses
from shardwise.deepspeed.params import ZeroParamStatus
from shardwise.deepspeed.stage3 import initialize
from shardwise.engine import Engine
from shardwise.engine.initialize import add_config_arguments
from shardwise.inference.compat import init_inference
from shardwise.optim import schedules
from shardwise.utils import moe, zero_to_fp32

# The DeepSpeed release whose API the facade implements; the facade's package version.
API_LEVEL = "0.19.8"
VERSION = f"{API_LEVEL}+shardwise"


def _take(module: ModuleType, wanted: list[str]) -> dict[str, Any]:
    """The named objects of ``module``; submodules are served as facade modules of their own."""
    return {n: getattr(module, n) for n in wanted if not isinstance(getattr(module, n), ModuleType)}


_ZERO = ["GatheredParameters", "Init", "MiCS_Init", "register_external_parameter", "unregister_external_parameter"]
_SCHEDULE_NAMES = ["WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR", "ONE_CYCLE", "LR_RANGE_TEST",
                   "VALID_LR_SCHEDULES", "CYCLE_MIN_LR", "CYCLE_MAX_LR"]
_PIPE = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
_major, _minor, _patch = (int(x) for x in API_LEVEL.split("."))

SURFACE: dict[str, dict[str, Any]] = {
    "deepspeed": {
        "initialize": initialize, "init_inference": init_inference, "add_config_arguments": add_config_arguments,
        "init_distributed": accelerate_state.init_distributed, "DeepSpeedEngine": Engine,
        "DeepSpeedConfigError": ConfigError, "tp_model_init": names.tp_model_init, "__version__": VERSION,
        "__version_major__": _major, "__version_minor__": _minor, "__version_patch__": _patch,
        "__git_hash__": "unknown", "__git_branch__": "unknown",
        "PipelineModule": pipeline.PipelineModule, "PipelineEngine": pipeline.PipelineEngine,
    },
    "deepspeed.comm": {**_take(comm_api, comm_api.__all__), "init_distributed": accelerate_state.init_distributed},
    "deepspeed.zero": _take(zero, _ZERO),
    "deepspeed.runtime": {},
    "deepspeed.runtime.engine": {"DeepSpeedEngine": Engine},
    "deepspeed.runtime.zero": _take(zero, [*_ZERO, "unwrap_model_for_generation"]),
    "deepspeed.runtime.zero.partition_parameters": {
        **_take(zero, _ZERO), **_take(names, ["zero_wrapper_for_fp_tensor_constructor", "_orig_torch_arange"]),
        "ZeroParamStatus": ZeroParamStatus},
    "deepspeed.runtime.zero.offload_config": {"OffloadDeviceEnum": names.OffloadDeviceEnum,
                                              "OffloadStateTypeEnum": names.OffloadStateTypeEnum},
    "deepspeed.runtime.lr_schedules": {
        **_take(schedules, ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]), **_take(names, _SCHEDULE_NAMES)},
    "deepspeed.runtime.config": {
        **_take(names, ["ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER", "ADAGRAD_OPTIMIZER",
                        "LION_OPTIMIZER"]), "DeepSpeedConfigError": ConfigError},
    "deepspeed.pipe": _take(pipeline, _PIPE),
    "deepspeed.runtime.pipe": _take(pipeline, [*_PIPE, "ProcessTopology"]),
    "deepspeed.runtime.pipe.module": _take(pipeline, _PIPE),
    "deepspeed.runtime.pipe.topology": _take(pipeline, [
        "ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid"]),
    "deepspeed.runtime.pipe.engine": {"PipelineEngine": pipeline.PipelineEngine},
    "deepspeed.runtime.utils": {"set_random_seed": pipeline.set_random_seed},
    "deepspeed.runtime.swap_tensor": {"MIN_SWAPPABLE_BYTES": names.MIN_SWAPPABLE_BYTES},
    "deepspeed.runtime.sequence_parallel": {},
    "deepspeed.runtime.sequence_parallel.ulysses_sp": _take(ulysses, [
        "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "TiledMLP", "TiledFusedLogitsLoss"]),
    "deepspeed.utils": _take(utils, utils.__all__),
    "deepspeed.utils.zero_to_fp32": _take(zero_to_fp32, zero_to_fp32.__all__),
    "deepspeed.utils.torch": {"required_torch_version": names.required_torch_version},
    "deepspeed.utils.groups": {"_get_sequence_parallel_group": ulysses.sequence_parallel_group,
                               "_get_sequence_parallel_world_size": ulysses.sequence_parallel_world_size,
                               "_get_sequence_parallel_rank": ulysses.sequence_parallel_rank},
    "deepspeed.checkpoint": {},
    "deepspeed.checkpoint.utils": {"clone_tensors_for_torch_save": utils.clone_tensors_for_torch_save},
    "deepspeed.moe": {},
    "deepspeed.moe.utils": _take(moe, ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer",
                                       "configure_moe_param_groups"]),
    "deepspeed.ops": {"__compatible_ops__": ops.COMPATIBLE_OPS},
    "deepspeed.ops.adam": _take(ops, ["DeepSpeedCPUAdam", "FusedAdam"]),
    "deepspeed.ops.adagrad": {"DeepSpeedCPUAdagrad": ops.DeepSpeedCPUAdagrad},
    "deepspeed.ops.lion": _take(ops, ["DeepSpeedCPULion", "FusedLion"]),
    "deepspeed.ops.op_builder": _take(ops, ["CPUAdamBuilder", "FusedAdamBuilder"]),
    "deepspeed.accelerator": _take(accelerator, ["get_accelerator", "is_current_accelerator_supported",
                                                 "set_accelerator"]),
    "deepspeed.launcher": {},
    "deepspeed.launcher.runner": {"DEEPSPEED_ENVIRONMENT_NAME": names.DEEPSPEED_ENVIRONMENT_NAME},
    "deepspeed.git_version_info": {"version": VERSION, "git_hash": "unknown", "git_branch": "unknown",
                                   "torch_info": names.torch_info},
}


def describe(value: Any) -> str:
    """What serves a name, for the generated list: the shardwise object's path, or the constant."""
    if isinstance(value, logging.Logger):
        return f"`logging.getLogger({value.name!r})`"
    qual = getattr(value, "__qualname__", None)
    module = getattr(value, "__module__", None)
    if qual and module and callable(value):
        return f"`{module}.{qual}`"
    if isinstance(value, dict) and type(value) is not dict:
        return f"`{type(value).__module__}.{type(value).__qualname__}`"
    return f"`{value!r}`"


def name_table() -> str:
    """The markdown list of every served DeepSpeed name (the block in docs/hf_trainer.md)."""
    lines = [f"DeepSpeed API level {API_LEVEL} (package version `{VERSION}`).", "",
             "| DeepSpeed name | served by |", "| --- | --- |"]
    for module, table in SURFACE.items():
        if not table:
            lines.append(f"| `{module}` | package (its submodules below) |")
        for name in sorted(table):
            lines.append(f"| `{module}.{name}` | {describe(table[name])} |")
    return "\n".join(lines) + "\n"
