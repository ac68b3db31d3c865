"""``shardwise.initialize`` with pipeline stages: a config's ``pipeline.stages`` splits a Hugging Face
causal LM (``pipeline/hf.py``) before the engine is built; everything else goes to the engine's
``initialize`` unchanged (which builds a ``PipelineModule``'s stage engine through its hook).

With ``expert_parallel`` in the config the model's experts are split first, over the EP groups of the
one rank grid cut inside each stage (``get_expert_mesh(ep, pp=stages)``), then the model is cut into
stages; the stage's engine adopts those groups (``pipeline/build.py``).

This sits above ``engine/`` (which never imports ``pipeline/``): ``shardwise.initialize`` and the
facade's ``deepspeed.initialize`` are this function.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist

from shardwise.comm import init_distributed
from shardwise.config import SupportedFeatures, load_config, read_config, timeout_of
from shardwise.engine.compat import UsageError
from shardwise.engine.initialize import TORCH_DISTRIBUTED_DEFAULT_PORT
from shardwise.engine.initialize import initialize as engine_initialize
from shardwise.layout import get_expert_mesh
from shardwise.moe import apply_from_config
from shardwise.pipeline.hf import lm_batch, pipeline_stages, split_causal_lm
from shardwise.pipeline.module import PipelineModule

_METHODS = ("uniform", "parameters")


def _split(model: Any, source: Any, dist_init_required: bool | None) -> PipelineModule | None:
    """The model as a PipelineModule when the config asks for stages and it is not one yet; else None."""
    raw = read_config(source)
    stages = pipeline_stages(raw)
    if isinstance(model, PipelineModule):
        if stages > 1 and stages != model.num_stages:
            raise UsageError(f"pipeline.stages {stages} disagrees with the PipelineModule's {model.num_stages} "
                             "stages; keep one")
        return None
    if stages == 1 or model is None:
        return None
    if not dist.is_initialized():
        if dist_init_required is False:
            raise UsageError("pipeline.stages needs the process group; dist_init_required=False but none is up")
        init_distributed(timeout=timeout_of(source))
    experts = _split_experts(model, source, stages)
    partition = str((raw.get("pipeline") or {}).get("partition", "uniform")).lower()
    module = split_causal_lm(model, stages, partition if partition in _METHODS or partition.startswith("type:")
                             else "uniform")
    module.expert_parallel = experts  # the stage's engine adopts its groups (None without experts split)
    return module


def _split_experts(model: Any, source: Any, stages: int) -> Any:
    """The config's ``expert_parallel`` applied to the whole model over each stage's EP groups, before
    it is cut into stages (collective); None when off. A router's auxiliary loss is refused: only
    hidden states cross between stages, so it would be dropped from the loss."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0):
        raise UsageError(f"pipeline.stages with {type(model).__name__}'s router auxiliary loss "
                         "(config.output_router_logits) is not served: only hidden states cross between stages, "
                         "so the aux loss would be dropped; set output_router_logits=False")
    cfg = load_config(source, world_size=dist.get_world_size() // stages,
                      supported=SupportedFeatures(stage3=True, offload_param=True))
    if not cfg.expert_parallel.enabled:
        return None
    return apply_from_config(model, cfg, get_expert_mesh(cfg.expert_parallel.autoep_size, pp=stages))


@functools.wraps(engine_initialize)
def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> tuple:
    source = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    source = source if source is not None else (config if config is not None else config_params)
    split = None if source is None else _split(model, source, dist_init_required)
    if split is not None:  # the stage's own parameters (the ones given belong to the whole model)
        model, model_parameters = split, None
    result = engine_initialize(args, model, optimizer, model_parameters, training_data, lr_scheduler,
                               distributed_port, mpu, dist_init_required, collate_fn, config, mesh_param,
                               config_params)
    if split is not None:
        result[0].set_batch_fn(lm_batch)
    return result


initialize.__module__, initialize.__qualname__ = __name__, "initialize"
