"""``model.state_dict()`` under expert parallelism: the full experts under their HF names.

A rank holds ``E / ep`` experts of each MoE layer, but every export a user reaches goes through
``state_dict()``: the HF Trainer's ``save_model`` at ZeRO-1/2 (accelerate's ``get_state_dict`` calls
it on every rank, then rank 0 saves), ``save_pretrained`` (which also turns the 3-D experts back
into the checkpoint's per-expert layout, and so needs all of them), PEFT. So each experts module
gets a state-dict post-hook that all-gathers its two 3-D parameters over the EP group: the result
holds ``[E, ...]`` tensors, exactly what the unsplit model returns, never ``[E/ep, ...]`` slices
under the full names. A load pre-hook does the reverse: ``load_state_dict`` of a full state dict
keeps this rank's experts (and refuses another expert count).

The contract is the one a sharded model's full state dict has everywhere (FSDP's
``FULL_STATE_DICT``, shardwise's ZeRO-3 ``GatheredParameters``): **a collective**. Every rank of the
EP group calls ``state_dict()`` (or ``save_pretrained`` with ``is_main_process``); at ZeRO-3 inside
``GatheredParameters`` as before. A call on one rank only (``if rank == 0: model.save_pretrained``)
cannot be served, and would wait forever in the gather: each hook first joins the other EP ranks
on a gloo group with a timeout (``join_timeout_s``, 600 s by default), and a rank left alone raises
one line saying so instead of hanging.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.checkpoint import gather_rows
from shardwise.comm import make_comm
from shardwise.moe.experts import expert_shard_of
from shardwise.moe.layouts import expert_params
from shardwise.zero.flat_group import owner_of

JOIN_TIMEOUT_S = 600.0


class StateDictNotCollectiveError(RuntimeError):
    """``state_dict()`` of an expert-parallel model was called on some EP ranks only."""


def _refuse_released(module: nn.Module, prefix: str) -> None:
    """ZeRO-3 outside ``GatheredParameters``: the parameters are shards (the model-level guard says
    so for ``model.state_dict()``; this covers a call on the experts' own module)."""
    for n in expert_params(module):
        g = owner_of(getattr(module, n))
        if g is not None and not g.is_gathered:
            raise RuntimeError(f"state_dict() at ZeRO stage 3: {prefix}{n} is sharded across ranks right now; "
                               "call it inside `with shardwise.zero.GatheredParameters(model.parameters()):` "
                               "on every rank, or use engine.save_16bit_model(dir)")


def _join(join: Any, timeout_s: float, prefix: str) -> None:
    try:
        make_comm(join).barrier()  # guarded: a peer that never comes is one RanksDivergedError
    except RuntimeError as e:
        where = prefix.rstrip(".") or "the model"
        raise StateDictNotCollectiveError(
            f"state_dict() under expert parallelism is collective (it gathers the experts of {where}) "
            f"but not every rank of this rank's expert-parallel group called it within {timeout_s:g} s: call "
            "state_dict() / save_pretrained(dir, is_main_process=rank == 0) on every rank") from e


def _full_experts(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: this module's expert slices -> the full tensors (collective over EP).
    Read from the module's ``ExpertShard``, which a deep copy keeps (a copied Parameter loses its
    own attributes)."""
    shard = expert_shard_of(module)
    if shard is None or shard.comm.size == 1:
        return
    _refuse_released(module, prefix)
    if shard.join is not None:
        _join(shard.join, shard.join_timeout_s, prefix)
    with torch.no_grad():
        for n in expert_params(module):
            p = getattr(module, n)
            if prefix + n in state_dict:
                state_dict[prefix + n] = gather_rows(p.detach(), shard.comm)


def _local_experts(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load pre-hook: a full ``[E, ...]`` expert tensor -> this rank's ``[E/ep, ...]`` experts."""
    shard = expert_shard_of(module)
    if shard is None or shard.comm.size == 1:
        return
    for n in expert_params(module):
        t = state_dict.get(prefix + n)
        if t is None:
            continue
        if t.dim() == 0 or t.shape[0] != shard.num_experts:
            raise ValueError(f"load_state_dict under expert parallelism: {prefix}{n} has shape {list(t.shape)}; "
                             f"expected the full {shard.num_experts} experts on dim 0 (each rank keeps its own)")
        state_dict[prefix + n] = t.narrow(0, shard.first, shard.local)


def install(modules: list[nn.Module]) -> None:
    """Give each split experts module the gathering state-dict hook and the slicing load hook (plain
    functions reading the module's ``ExpertShard``, so a deep-copied model keeps working hooks)."""
    for m in modules:
        m.register_state_dict_post_hook(_full_experts)
        m.register_load_state_dict_pre_hook(_local_experts)
