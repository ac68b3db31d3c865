"""``shardwise.initialize`` with pipeline stages: a config's ``pipeline.stages`` splits a Hugging Face
causal LM (``pipeline/hf.py``) before the engine is built; everything else goes to the engine's
``initialize`` unchanged (which builds a ``PipelineModule``'s stage engine through its hook).

With ``expert_parallel`` or ``tensor_parallel.autotp_size`` in the config the whole model is split
first, over the EP or TP groups of the one rank grid cut inside each stage (``get_expert_mesh(ep,
pp=stages)``, ``get_mesh(tp, pp=stages)``), then cut into stages; the stage's engine adopts those
groups (``pipeline/build.py``).

This sits above ``engine/`` (which never imports ``pipeline/``): ``shardwise.initialize`` and the
facade's ``deepspeed.initialize`` are this function.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm import init_distributed, make_comm
from shardwise.config import SupportedFeatures, load_config, read_config, timeout_of
from shardwise.engine.compat import UsageError
from shardwise.engine.initialize import TORCH_DISTRIBUTED_DEFAULT_PORT
from shardwise.engine.initialize import initialize as engine_initialize
from shardwise.layout import Mesh, get_expert_mesh, get_mesh
from shardwise.moe import apply_from_config
from shardwise.pipeline.hf import lm_batch, pipeline_stages, pipeline_virtual_stages, split_causal_lm
from shardwise.pipeline.module import PipelineModule
from shardwise.pipeline.topology import PipeModelDataParallelTopology
from shardwise.tensor_parallel import apply_tensor_parallel

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
    cfg = load_config(source, world_size=dist.get_world_size() // stages,
                      supported=SupportedFeatures(stage3=True, offload_param=True, tensor_parallel=True))
    _refuse_split(model, cfg)
    if pipeline_virtual_stages(raw) > 1 and (cfg.tp_size > 1 or cfg.expert_parallel.enabled):
        raise UsageError("pipeline.virtual_stages > 1 with tensor or expert parallelism is not served by shardwise")
    experts = _split_experts(model, cfg, stages)
    mesh = _split_tensors(model, cfg, stages)
    partition = str((raw.get("pipeline") or {}).get("partition", "uniform")).lower()
    module = split_causal_lm(model, stages, partition if partition in _METHODS or partition.startswith("type:")
                             else "uniform", pipeline_virtual_stages(raw))
    model.register_forward_pre_hook(_split_away)
    if mesh is not None:  # the stages' grid with its model axis: the groups the layers were split over
        world = dist.get_world_size()
        module.use_topology(PipeModelDataParallelTopology(stages, cfg.tp_size, world // (stages * cfg.tp_size)), mesh)
    module.expert_parallel = experts  # the stage's engine adopts its groups (None without experts split)
    return module


def _split_away(module: Any, args: Any) -> None:
    """The model given to ``initialize`` no longer computes what the stages hold: this rank trains its
    stage only (the others' layers are stale here, or on meta), so a call of it would be a wrong number."""
    raise UsageError(f"this {type(module).__name__} was split into pipeline stages by initialize "
                     "(pipeline.stages); run it through the engine: engine.train_batch(), eval_batch() or "
                     "generate()")


def _refuse_split(model: Any, cfg: Any) -> None:
    """What a Hugging Face model cut by ``pipeline.stages`` does not serve, one line each."""
    config = getattr(model, "config", None)
    unserved = {
        # only hidden states cross between stages: the router's aux loss would be dropped from the loss
        f"{type(model).__name__}'s router auxiliary loss (set config.output_router_logits=False)": (
            getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0)),
        # the decoder entries make masks and positions for whole sequences; Ulysses is the script's layers'
        "sequence_parallel_size > 1 (use a PipelineModule whose layers exchange over engine.grid.sp_comm())": (
            cfg.sequence_parallel_size > 1),
        # the tied head would multiply by the embedding's vocabulary shard alone
        "tensor_parallel.autotp_size > 1 with tie_word_embeddings": (
            cfg.tp_size > 1 and getattr(config, "tie_word_embeddings", False)),
        # TP and EP slice the whole model before the cut, and a stage_init() build has only meta tensors
        "tensor or expert parallelism on a model built under stage_init() (build it whole)": (
            (cfg.tp_size > 1 or cfg.expert_parallel.enabled) and any(p.is_meta for p in model.parameters())),
    }
    for what, on in unserved.items():
        if on:
            raise UsageError(f"pipeline.stages with {what} is not served by shardwise")


def _split_experts(model: Any, cfg: Any, stages: int) -> Any:
    """The config's ``expert_parallel`` applied to the whole model over each stage's EP groups, before
    it is cut into stages (collective); None when off."""
    if not cfg.expert_parallel.enabled:
        return None
    return apply_from_config(model, cfg, get_expert_mesh(cfg.expert_parallel.autoep_size, pp=stages))


def _split_tensors(model: Any, cfg: Any, stages: int) -> Mesh | None:
    """``tensor_parallel.autotp_size`` > 1: the whole model sliced over each stage's TP groups (the
    model's own plan, as without stages; every rank from rank 0's weights) before it is cut into
    stages (collective); the stage's groups. None without TP."""
    if cfg.tp_size == 1:
        return None
    mesh = get_mesh(cfg.tp_size, pp=stages)
    world = make_comm("world", mesh.stats)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            world.broadcast(t.data, src=0)
    apply_tensor_parallel(model, mesh.tp)
    return mesh


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
