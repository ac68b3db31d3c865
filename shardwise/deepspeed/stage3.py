"""``deepspeed.initialize`` of the facade: shardwise's, plus the stage-3 parameter attributes that
libraries written for DeepSpeed read.

At stage 3 DeepSpeed marks every partitioned parameter with ``ds_id``, ``ds_numel``, ``ds_shape``
and ``ds_tensor``; transformers (``num_parameters``), peft (layer shapes, parameter counts) and
trl test for them to learn the true size of a parameter whose ``.data`` is a placeholder.
shardwise's placeholders keep the full shape, so the sizes are right either way; the attributes
are set so that code taking DeepSpeed's branch reads the same numbers.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref
from typing import Any

import torch

from shardwise.config import read_config
from shardwise.config.schema import ConfigError
from shardwise.deepspeed.accelerate_state import process_count_note
from shardwise.deepspeed.params import attach
from shardwise.engine import Engine
from shardwise.pipeline.entry import initialize as shardwise_initialize  # the engine's, with pipeline.stages


def mark_stage3_params(engine: Engine) -> None:
    """Set DeepSpeed's stage-3 attributes on every parameter a stage-3 group shards.

    ``ds_id``: a unique index; ``ds_numel`` / ``ds_shape``: the whole parameter's (TP-local)
    size; ``ds_tensor``: this rank's piece of it, a 1-D view of the group's persistent shard, or of
    this rank's range of a group kept whole (small parameters under
    ``stage3_param_persistence_threshold``); empty when the piece lies on other ranks, None when
    the shard lives in files.
    """
    if not engine.policy.shard_params:
        return
    next_id = 0
    for group in engine.sharding.all_groups:
        shard = group.param_shard
        if shard is None and not group.store.rereads:  # kept whole: this rank's range of the buffer
            shard = group.flat_param.narrow(0, group.own_start, group.own_numel)
        pieces = {seg.index: seg for seg in group.owned}
        for i, p in enumerate(group.params):
            seg = pieces.get(i)
            p.ds_id, p.ds_numel, p.ds_shape = next_id, p.numel(), torch.Size(p.shape)
            if shard is None:
                p.ds_tensor = None
            elif seg is None:
                p.ds_tensor = shard.new_empty(0)
            else:
                p.ds_tensor = shard.narrow(0, seg.offset, seg.length)
            next_id += 1


# DeepSpeed 0.19.8's default for a config without "gradient_clipping" (runtime/constants.py:
# GRADIENT_CLIPPING_DEFAULT = 1.0: it clips at a global norm of 1.0); shardwise's own default is 0 (off).
DEEPSPEED_GRADIENT_CLIPPING = 1.0


def with_deepspeed_defaults(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with its config (``config``, ``config_params`` or ``args.deepspeed_config``)
    read into a dict given DeepSpeed's defaults where they differ from shardwise's, so that a
    DeepSpeed script computes DeepSpeed's numbers."""
    bound = inspect.signature(shardwise_initialize).bind_partial(*args, **kwargs)
    given = bound.arguments
    config = given.get("config") if given.get("config") is not None else given.get("config_params")
    cli = given.get("args")
    from_args = getattr(cli, "deepspeed_config", None) or getattr(cli, "deepscale_config", None)
    if from_args is not None and config is not None:
        return args, kwargs  # two configs: shardwise's initialize says so
    if from_args is not None:
        config, cli = from_args, copy.copy(cli)
        cli.deepspeed_config = None
        if hasattr(cli, "deepscale_config"):
            cli.deepscale_config = None
        given["args"] = cli
    if config is None:
        return args, kwargs  # shardwise's initialize asks for one
    raw = read_config(config)
    raw.setdefault("gradient_clipping", DEEPSPEED_GRADIENT_CLIPPING)
    given.pop("config_params", None)
    given["config"] = raw
    return bound.args, bound.kwargs


def bind_optimizer_offload_calls(engine: Engine) -> None:
    """``engine.optimizer.offload_states(...)`` / ``reload_states(...)``: DeepSpeed's ZeRO optimizers (stages
    1-3) carry them, and RL frameworks (OpenRLHF's ``offload_deepspeed_states``, verl, ROLL) call them there,
    not on the engine. They are the engine's (``engine/offload_states.py``), through a weak reference: the
    optimizer must not keep a destroyed engine (and its swap files) alive."""
    if engine.optimizer is None:
        return
    ref = weakref.ref(engine)

    def offload_states(include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        ref().offload_states(include, device, pin_memory, non_blocking)

    def reload_states(non_blocking: bool = False) -> None:
        ref().reload_states(non_blocking)

    engine.optimizer.offload_states, engine.optimizer.reload_states = offload_states, reload_states


@functools.wraps(shardwise_initialize)
def initialize(*args: Any, **kwargs: Any) -> tuple[Engine, Any, Any, Any]:
    args, kwargs = with_deepspeed_defaults(args, kwargs)
    try:
        result = shardwise_initialize(*args, **kwargs)
    except ConfigError as e:  # a batch size filled for the wrong process count: say why, and the fix
        note = process_count_note() if "train_batch_size" in str(e) else None
        if note is None:
            raise
        raise ConfigError(f"{e}. {note}") from None
    mark_stage3_params(result[0])
    attach(result[0])  # ds_status, ds_external_parameters(), optimizer.parameter_offload (params.py)
    bind_optimizer_offload_calls(result[0])
    return result


initialize.__module__, initialize.__qualname__ = __name__, "initialize"  # wraps() copied shardwise's
