"""``shardwise.initialize``: DeepSpeed's entry point, same arguments, same return value."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shardwise.comm import init_distributed
from shardwise.config import SupportedFeatures, load_config, timeout_of
from shardwise.engine import Engine
from shardwise.mesh import get_mesh


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


def initialize(
    model: nn.Module,
    config: Any = None,
    model_parameters: Any = None,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    training_data: Dataset | None = None,
    collate_fn: Callable | None = None,
    config_params: Any = None,
    args: Any = None,
) -> tuple[Engine, Any, DataLoader | None, Any]:
    """Wrap ``model`` for sharded training; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``config`` is a DeepSpeed JSON path or dict (``config_params`` is DeepSpeed's
    older name for it). Joins the torchrun job first if needed.
    """
    if model is None:
        raise ValueError("initialize(model=...) is required")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    init_distributed(timeout=timeout_of(config))  # config key shardwise.timeout_s, else SHARDWISE_TIMEOUT
    _setup_logging()
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    cfg = load_config(config, world_size=dist.get_world_size(), hidden_size=hidden,
                      supported=SupportedFeatures(stage3=True, offload_param=True, tensor_parallel=True,
                                                         hybrid=True))
    shard = cfg.zero_optimization.mics_shard_size
    mesh = get_mesh(cfg.tp_size, shard if shard > 0 else None)
    engine = Engine(model, cfg, model_parameters=model_parameters, optimizer=optimizer,
                    lr_scheduler=lr_scheduler, comm=mesh.dp, tp=mesh.tp, replicate=mesh.replicate)
    loader = None
    if training_data is not None:
        sampler = DistributedSampler(training_data, num_replicas=engine.dp_world, rank=engine.dp_rank,
                                     shuffle=True, seed=cfg.seed if getattr(cfg, "seed", None) else 0)
        loader = DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu,
                            sampler=sampler, collate_fn=collate_fn,
                            drop_last=cfg.dataloader_drop_last)
    engine.training_dataloader = loader
    return engine, engine.optimizer, loader, engine.lr_scheduler
