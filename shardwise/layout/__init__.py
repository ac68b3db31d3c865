"""``shardwise.layout``: the run's layout of ranks, built once.

- ``grid``: the one rank grid every process group is cut from (pipeline stages outermost; replicate x
  shard x TP; SP; EP x EDP inside each stage);
  ``get_mesh``, ``get_sequence_mesh``, ``get_expert_mesh`` for scripts that cut groups themselves.
- :func:`check_combinations` (from ``config/combinations.py``, where ``load_config`` runs it too): every
  refusal of a combination of degrees, in one function.
- ``run``: :class:`RunLayout`, made from the config at the start of ``initialize`` (and of ``shard()``):
  every degree, every group, one ``CommStats``.
"""

from __future__ import annotations

from shardwise.config.combinations import check_combinations
from shardwise.layout.grid import (
    ExpertMesh,
    Mesh,
    SequenceMesh,
    get_expert_join_group,
    get_expert_mesh,
    get_mesh,
    get_pipe_group,
    get_sequence_mesh,
)
from shardwise.layout.run import RunLayout

__all__ = ["ExpertMesh", "Mesh", "RunLayout", "SequenceMesh", "check_combinations", "get_expert_join_group",
           "get_expert_mesh", "get_mesh", "get_pipe_group", "get_sequence_mesh"]
