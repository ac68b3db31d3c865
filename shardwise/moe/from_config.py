"""The config's ``expert_parallel`` section (DeepSpeed AutoEP's keys) applied to a model.

Called by ``shardwise.initialize`` (so DeepSpeed scripts, the facade and the HF Trainer get it) with
the run layout's EP groups, before the engine shards the model: the experts are split first, then
ZeRO shards every other parameter over all ranks and the experts over the expert-data-parallel group.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.errors import UserError
from shardwise.layout import ExpertMesh
from shardwise.moe.apply import ExpertParallel, apply_expert_parallel, expert_parallel_of


def apply_from_config(model: nn.Module, cfg: Any, mesh: ExpertMesh | None = None) -> ExpertParallel | None:
    """Split the experts when ``expert_parallel.enabled`` (collective); None when it is off.

    ``mesh``: the run layout's EP groups (``RunLayout.expert``, counted into the run's one
    ``CommStats``); the layout has refused the combinations EP does not serve yet."""
    section = cfg.expert_parallel
    if not section.enabled:
        return None
    done = expert_parallel_of(model)
    if done is not None:  # initialize() again on a model an earlier engine split
        if done.ep_size != section.autoep_size:
            raise UserError(f"expert_parallel.autoep_size {section.autoep_size}: the model is split "
                             f"{done.ep_size}-way already")
        return done
    return apply_expert_parallel(model, section.autoep_size, preset=section.preset_model, mesh=mesh)
