"""``shardwise.initialize`` with pipeline stages: a config's ``pipeline.stages`` splits a Hugging Face
causal LM (``pipeline/hf.py``) before the engine is built; everything else goes to the engine's
``initialize`` unchanged (which builds a ``PipelineModule``'s stage engine through its hook).

This sits above ``engine/`` (which never imports ``pipeline/``): ``shardwise.initialize`` and the
facade's ``deepspeed.initialize`` are this function.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist

from shardwise.comm import init_distributed
from shardwise.config import read_config, timeout_of
from shardwise.engine.compat import UsageError
from shardwise.engine.initialize import TORCH_DISTRIBUTED_DEFAULT_PORT
from shardwise.engine.initialize import initialize as engine_initialize
from shardwise.pipeline.hf import lm_batch, pipeline_stages, pipeline_virtual_stages, split_causal_lm
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
    partition = str((raw.get("pipeline") or {}).get("partition", "uniform")).lower()
    split = split_causal_lm(model, stages, partition if partition in _METHODS or partition.startswith("type:")
                            else "uniform", pipeline_virtual_stages(raw))
    model.register_forward_pre_hook(_split_away)
    return split


def _split_away(module: Any, args: Any) -> None:
    """The model given to ``initialize`` no longer computes what the stages hold: this rank trains its
    stage only (the others' layers are stale here, or on meta), so a call of it would be a wrong number."""
    raise UsageError(f"this {type(module).__name__} was split into pipeline stages by initialize "
                     "(pipeline.stages); run it through the engine: engine.train_batch(), eval_batch() or "
                     "generate()")


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
