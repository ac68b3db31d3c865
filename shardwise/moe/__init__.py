"""Mixture-of-experts: expert parallelism for transformers-5 MoE models (see docs/moe.md).

- ``apply_expert_parallel(model, ep_size, preset=None)``: split each MoE layer's experts over
  ``ep_size`` consecutive ranks (before ``shard()`` / the engine shard the rest); the model's own
  router, top-k, normalization and aux loss are kept.
- ``dispatch`` / ``combine``: the variable-split all-to-all token exchange (autograd-correct).
- ``expert_layout``, ``FAMILIES``, ``PRESETS``: which HF model families have a known layout.
- ``apply_from_config(model, cfg)``: the config's ``expert_parallel`` section (DeepSpeed AutoEP's
  keys), called by ``shardwise.initialize``.
- ``get_expert_mesh``: the EP and expert-data-parallel groups (``shardwise.layout``).
- After the split, ``model.state_dict()`` (so ``save_pretrained``, the HF Trainer's ``save_model``)
  returns the full experts; it is collective over the EP group, and a rank calling it alone raises
  ``StateDictNotCollectiveError`` after the join timeout (``export.py``). A model built under
  ``zero.Init`` gets only its own experts materialized (``deferred.py``).
- ``restore_expert_groups(model)``: a deep copy's experts marked again (``fsdp.shard_module`` calls it).
"""

from shardwise.layout import ExpertMesh, get_expert_mesh
from shardwise.moe.apply import (
    ExpertParallel,
    apply_expert_parallel,
    expert_parallel_of,
    is_expert_param,
    restore_expert_groups,
)
from shardwise.moe.dispatch import Routed, combine, dispatch
from shardwise.moe.experts import IMPLEMENTATION, run_local_experts
from shardwise.moe.export import StateDictNotCollectiveError
from shardwise.moe.from_config import apply_from_config
from shardwise.moe.layouts import FAMILIES, PRESETS, ExpertLayout, UnsupportedMoEError, expert_layout

__all__ = ["FAMILIES", "IMPLEMENTATION", "PRESETS", "ExpertLayout", "ExpertMesh", "ExpertParallel", "Routed",
           "StateDictNotCollectiveError", "UnsupportedMoEError", "apply_expert_parallel", "apply_from_config",
           "combine", "dispatch", "expert_layout", "expert_parallel_of", "get_expert_mesh", "is_expert_param",
           "restore_expert_groups", "run_local_experts"]
