"""The experts forward under expert parallelism, registered with transformers' experts interface.

``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` maps ``config._experts_implementation`` to
the function every ``@use_experts_implementation`` module calls; :data:`IMPLEMENTATION` is ours.
It dispatches the (token, expert) pairs to the EP ranks, runs each local expert as one matmul over
the contiguous block of its tokens (gate-up, the module's own gate, down) and combines the results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.comm import Comm
from shardwise.moe.dispatch import combine, dispatch

IMPLEMENTATION = "shardwise_ep"
_STATE = "shardwise_ep"  # the attribute an experts module keeps its ExpertShard in


@dataclass
class ExpertShard:
    """What one experts module holds under EP: experts ``first .. first + local - 1`` of ``num_experts``."""

    comm: Comm
    num_experts: int
    first: int
    local: int
    join: Any = None  # the EP ranks' gloo group with a timeout (moe/export.py: state_dict's join check)
    join_timeout_s: float = 0.0

    def __deepcopy__(self, memo: dict) -> ExpertShard:
        return self  # a deep-copied model holds the same slices and talks over the same group


def expert_shard_of(module: nn.Module) -> ExpertShard | None:
    return getattr(module, _STATE, None)


def set_expert_shard(module: nn.Module, shard: ExpertShard) -> None:
    setattr(module, _STATE, shard)


def _project(module: nn.Module, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """Local expert ``e``'s projection ``name`` of ``x``, as transformers' experts functions compute it:
    ``x @ W[e]`` when the module stores its weights transposed (GPT-OSS), else ``x @ W[e].T``, plus
    the expert's bias ``<name>_bias[e]`` when the module has biases."""
    w = getattr(module, name)[e]
    out = x @ w if module.is_transposed else F.linear(x, w)
    return out + getattr(module, f"{name}_bias")[e] if module.has_bias else out


def run_local_experts(module: nn.Module, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Expert e of this rank on rows ``counts[e]`` of ``x`` (grouped by expert), one matmul each:
    gate-up, the module's own gate (``_apply_gate``: its activation, its gate/up interleaving, GPT-OSS's
    clamps), down.

    Every local expert runs, with an empty block when it got no token: its weights stay in the
    autograd graph, so their gradient is a zero tensor rather than missing on some ranks only.
    """
    outs = []
    for e, block in enumerate(x.split(counts)):
        h = module._apply_gate(_project(module, "gate_up_proj", e, block))
        outs.append(_project(module, "down_proj", e, h))
    return torch.cat(outs) if outs else x


def ep_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``shardwise_ep`` experts implementation (signature of transformers' experts functions)."""
    shard = expert_shard_of(module)
    if shard is None:
        raise RuntimeError(f"{type(module).__name__}: config._experts_implementation is {IMPLEMENTATION!r} but "
                           "this module was not split by shardwise.moe.apply_expert_parallel")
    x, routed = dispatch(hidden_states, top_k_index, shard.num_experts, shard.comm)
    out = run_local_experts(module, x, routed.counts)
    return combine(out, top_k_weights, routed, shard.comm)


def register() -> None:
    """Make ``shardwise_ep`` a valid ``config._experts_implementation`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, ep_experts_forward)
