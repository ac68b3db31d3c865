"""``shardwise.mesh``: the rank grid's old path, kept for scripts that import from it.

The groups moved into :mod:`shardwise.layout` (``layout/grid.py``), where the run layout cuts every
group of a run once. Scripts written against earlier releases (``from shardwise.mesh import
get_mesh``, as the tensor-parallel docs showed) keep working through these names; new code imports
``shardwise.layout``.
"""

from __future__ import annotations

from shardwise.layout import (
    ExpertMesh,
    Mesh,
    SequenceMesh,
    get_expert_join_group,
    get_expert_mesh,
    get_mesh,
    get_sequence_mesh,
)

__all__ = ["ExpertMesh", "Mesh", "SequenceMesh", "get_expert_join_group", "get_expert_mesh", "get_mesh",
           "get_sequence_mesh"]
