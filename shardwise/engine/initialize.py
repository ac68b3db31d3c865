"""``shardwise.initialize``: DeepSpeed's entry point, same arguments in the same order, same return.

Also DeepSpeed's ``add_config_arguments(parser)``, so a script written for DeepSpeed runs with only
``import deepspeed`` replaced by ``import shardwise as deepspeed``.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shardwise.comm import init_distributed
from shardwise.config import ShardwiseConfig, SupportedFeatures, load_config, read_config, timeout_of
from shardwise.engine.compat import UsageError
from shardwise.engine.engine import Engine
from shardwise.engine.mpu import mesh_from_mpu, mpu_sizes
from shardwise.fsdp.module import is_sharded
from shardwise.fsdp.unshard import unshard_module
from shardwise.layout import RunLayout
from shardwise.moe import apply_from_config, expert_parallel_of
from shardwise.sequence_parallel import SequenceParallelMPU

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


def _setup_logging() -> None:
    log = logging.getLogger("shardwise")
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not any(getattr(h, "_shardwise", False) for h in log.handlers):
        h = logging.StreamHandler()
        h._shardwise = True
        h.setFormatter(logging.Formatter("[shardwise] %(message)s"))
        log.addHandler(h)
        log.propagate = False


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags (``--deepspeed``, ``--deepspeed_config`` and the deprecated
    ``--deepscale``, ``--deepscale_config``) to ``parser``; returns it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (shardwise)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script itself; shardwise ignores it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    return parser


def _config_from_args(args: Any, config: Any) -> Any:
    """DeepSpeed's rule: ``args.deepspeed_config`` (or the deprecated ``deepscale_config``) is read
    when present, and giving both it and ``config=`` is an error."""
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise UsageError("a config was given both as args.deepspeed_config and as initialize(config=...); "
                             "keep one")
        return from_args
    if config is None:
        raise UsageError("initialize() needs a config: pass config= (a JSON path or dict) or "
                         "args with --deepspeed_config")
    return config


def _join(dist_init_required: bool | None, distributed_port: int, timeout: float | None) -> None:
    if dist_init_required is False:
        if not dist.is_initialized():
            raise UsageError("Distributed backend is not initialized. Please set dist_init_required to True "
                             "or initialize before calling initialize()")
        return
    if "RANK" in os.environ:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    init_distributed(timeout=timeout)  # config key shardwise.timeout_s, else SHARDWISE_TIMEOUT


def _finish_pending(ref: weakref.ref) -> None:
    """At exit: wait for the engine's in-flight all-gathers (stages 1-2 publish the last step's
    parameters asynchronously), so no collective is still running when the process ends."""
    engine = ref()
    if engine is not None and dist.is_initialized():
        engine.wait_for_params()


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[Engine, Any, DataLoader | None, Any]:
    """Wrap ``model`` for sharded training; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    As DeepSpeed: ``config`` (or its older name ``config_params``, or ``args.deepspeed_config``)
    is a JSON/hjson path or a dict; ``optimizer`` (an optimizer or a factory of one) overrides the
    config's ``optimizer`` section; with neither the engine serves evaluation and inference only
    and the returned optimizer is None. ``mpu`` (Megatron-style: ``get_model_parallel_group()``,
    ``get_data_parallel_group()``, ...) gives the groups of a model the script already split
    across ranks; ZeRO then shards over its data-parallel group.
    """
    if model is None:
        raise UsageError("initialize(model=...) is required")
    if mesh_param is not None:
        raise NotImplementedError("initialize(mesh_param=...): DeepSpeed's sequence-parallel mesh is not "
                                  "implemented by shardwise; drop mesh_param")
    if config is None:
        config = config_params
    config = _config_from_args(args, config)
    sp_mpu = mpu if isinstance(mpu, SequenceParallelMPU) else None
    if sp_mpu is not None:  # DeepSpeed's register_with_transformers: SP over shardwise's own groups
        config, mpu = with_sequence_parallel(config, sp_mpu.get_sequence_parallel_world_size()), None
    _join(dist_init_required, distributed_port, timeout_of(config))
    _setup_logging()
    build_stage = getattr(model, "engine_builder", None)  # a PipelineModule: its stage's engine (shardwise/pipeline/)
    if build_stage is not None:
        return build_stage(model, config, optimizer=optimizer, model_parameters=model_parameters,
                           training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn)
    cfg, layout = _config_and_layout(config, model, mpu, sp_mpu is not None)
    loader = None if training_data is None else _dataloader(training_data, layout, cfg, collate_fn)
    if is_sharded(model):  # initialize() again on a model an earlier engine wraps, as DeepSpeed allows
        unshard_module(model)
    apply_from_config(model, cfg, layout.expert)  # expert_parallel: split the experts before ZeRO shards the rest
    split = expert_parallel_of(model)  # also a model the script split itself (apply_expert_parallel)
    if split is not None:
        layout.adopt_experts(split.mesh)
    engine = Engine(model, cfg, model_parameters=model_parameters, optimizer=optimizer,
                    lr_scheduler=lr_scheduler, model_is_tp=mpu is not None, layout=layout)
    engine.mpu = mpu if sp_mpu is None else sp_mpu
    atexit.register(_finish_pending, weakref.ref(engine))
    engine.training_dataloader = loader
    return engine, engine.optimizer, loader, engine.lr_scheduler


def with_sequence_parallel(config: Any, sp_size: int) -> dict:
    """``config`` (a path or dict) as a dict with ``sequence_parallel_size`` = ``sp_size``; a config
    asking for another size is refused."""
    raw = read_config(config)
    given = raw.get("sequence_parallel_size")
    if given not in (None, 1, sp_size):
        raise UsageError(f"the config's sequence_parallel_size {given} disagrees with the mpu's sequence-parallel "
                         f"size {sp_size}; keep one")
    return {**raw, "sequence_parallel_size": sp_size}


def _config_and_layout(config: Any, model: nn.Module, mpu: Any,
                       sp_mpu: bool = False) -> tuple[ShardwiseConfig, RunLayout]:
    """The loaded config (the batch rule over data-parallel ranks) and the run's layout: every group
    cut once (``shardwise/layout/``), or the script's ``mpu`` groups when given. ``sp_mpu``: the
    config's SP came from DeepSpeed's SP mpu (``register_with_transformers``)."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    world = dist.get_world_size()
    if mpu is not None:
        world = mpu_sizes(mpu)[1]  # the batch rule counts data-parallel ranks only
    cfg = load_config(config, world_size=world, hidden_size=hidden, mpu=mpu, sp_from_mpu=sp_mpu,
                      supported=SupportedFeatures.everything() if mpu is None else
                      SupportedFeatures(stage3=True, offload_param=True, tensor_parallel=True))
    if mpu is not None:
        return cfg, RunLayout.from_config(cfg, mpu=mpu, mesh_of_mpu=lambda: mesh_from_mpu(mpu, model))
    return cfg, RunLayout.from_config(cfg)


def _dataloader(training_data: Dataset, layout: RunLayout, cfg: ShardwiseConfig,
                collate_fn: Callable | None) -> DataLoader:
    """DeepSpeed's training loader: this data-parallel rank's part, micro-batch sized (the engine's
    ``dp_world`` / ``dp_rank``: the same ``layout.data_parallel``), made before anything is sharded."""
    replicas, rank = layout.data_parallel(cfg.sequence_parallel_size)
    sampler = DistributedSampler(training_data, num_replicas=replicas, rank=rank,
                                 shuffle=True, seed=cfg.seed if getattr(cfg, "seed", None) else 0)
    return DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler,
                      collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last)
