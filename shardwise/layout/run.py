"""``RunLayout``: a run's degrees and groups, made once from the config, with one byte counter.

Before any parameter moves, :meth:`RunLayout.from_config` runs every combination check
(``check_combinations``, ``config/combinations.py``) and cuts every group the run needs from the
one rank grid (``layout/grid.py``): ZeRO's shard, replica and hpZ groups, TP's, SP's and EP's.
Every group counts into the layout's one :class:`~shardwise.comm.CommStats`, so
``engine.comm_stats()``, the comms logger and the per-rank report see every collective of the run,
the sequence exchange's and expert dispatch's all-to-alls included. The engine, ZeRO, sequence
parallelism and expert parallelism receive their groups from it and cut none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from shardwise.comm import CommStats
from shardwise.config.combinations import check_combinations
from shardwise.layout.grid import ExpertMesh, Mesh, SequenceMesh, get_expert_mesh, get_mesh, get_sequence_mesh


@dataclass
class RunLayout:
    """Every degree of a run and the groups cut for them (who receives what: docs/architecture.md)."""

    mesh: Mesh  # ZeRO's shard group (dp), tp, the replicas (hybrid sharding), every data rank, hpZ's secondary
    sequence: SequenceMesh | None  # SP and its data replicas; None at SP 1
    expert: ExpertMesh | None  # EP and the expert-data-parallel ranks; None without expert parallelism
    stats: CommStats  # the one counter every group above adds to

    @property
    def world(self) -> int:
        return self.mesh.tp.size * self.mesh.dp_full.size

    @property
    def tp(self) -> int:
        return self.mesh.tp.size

    @property
    def dp(self) -> int:
        """The ranks ZeRO reduces over (SP ranks are data-parallel ranks to it)."""
        return self.mesh.dp_full.size

    @property
    def shard(self) -> int:
        """ZeRO's shard group size (``dp`` unless hybrid sharding)."""
        return self.mesh.dp.size

    @property
    def replicas(self) -> int:
        """Copies of each shard (hybrid sharding; 1 for plain ZeRO)."""
        return self.mesh.replicate.size

    @property
    def hpz(self) -> int:
        """ZeRO++ hpZ's secondary group size (1 without it)."""
        return self.mesh.secondary.size if self.mesh.secondary is not None else 1

    @property
    def sp(self) -> int:
        return self.sequence.sp.size if self.sequence is not None else 1

    @property
    def ep(self) -> int:
        return self.expert.ep.size if self.expert is not None else 1

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts (their gradients are reduced over these only)."""
        return self.expert.edp.size if self.expert is not None else self.dp

    def data_parallel(self, sp: int) -> tuple[int, int]:
        """``(replicas, this rank's index)`` of the data, for the sampler and the batch rule: ZeRO shards
        over SP x DP ranks (shard group x its replicas), and the ``sp`` ranks of one SP group read one sample set."""
        dp, rep = self.mesh.dp, self.mesh.replicate
        return dp.size * rep.size // sp, (rep.rank * dp.size + dp.rank) // sp

    def degrees(self) -> dict[str, int]:
        """Every degree by name (for reports and logs)."""
        return {"world": self.world, "dp": self.dp, "tp": self.tp, "sp": self.sp, "ep": self.ep,
                "expert_dp": self.expert_dp, "shard": self.shard, "replicas": self.replicas, "hpz": self.hpz}

    def adopt_experts(self, mesh: ExpertMesh) -> None:
        """Take the EP groups a model was split over (``apply_expert_parallel`` before ``initialize``,
        or an earlier engine's) as this run's: their comms count into this layout's counter from now on."""
        for comm in (mesh.ep, mesh.edp):
            comm.stats = self.stats
        self.expert = mesh

    @classmethod
    def of(cls, tp: int = 1, shard: int | None = None, hpz: int = 1, sp: int = 1, ep: int = 0,
           pp: int = 1) -> RunLayout:
        """The layout for these degrees (collective: every rank, same arguments). ``shard``: None for
        every data-parallel rank; ``ep`` 0: no expert parallelism (1: experts marked, not split);
        ``pp``: pipeline stages, outermost (every group above is cut inside one stage's ranks)."""
        stats = CommStats()
        mesh = get_mesh(tp, shard, secondary_size=hpz, stats=stats, pp=pp)
        sequence = get_sequence_mesh(sp, stats, tp_size=tp, pp=pp) if sp > 1 else None
        expert = get_expert_mesh(ep, stats, pp=pp) if ep >= 1 else None
        return cls(mesh, sequence, expert, stats)

    @classmethod
    def from_config(cls, cfg: Any, mpu: Any = None, mesh_of_mpu: Callable[[], Mesh] | None = None) -> RunLayout:
        """The run's layout from a loaded config, after :func:`check_combinations` (collective).

        ``mpu``: a Megatron-style object whose groups the script cut; ``mesh_of_mpu()`` makes them
        the layout's mesh (``engine/mpu.py``), its counter the layout's (TP, SP or EP beside an mpu is
        refused by the check, which ``load_config`` ran before with the mpu's data-parallel world)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_combinations(cfg, world, mpu)
        ep = cfg.expert_parallel.autoep_size if cfg.expert_parallel.enabled else 0
        if mpu is not None and mesh_of_mpu is not None:
            mesh = mesh_of_mpu()
            return cls(mesh, None, None, mesh.stats)
        zero = cfg.zero_optimization
        shard = zero.mics_shard_size if zero.mics_shard_size > 0 else None
        return cls.of(cfg.tp_size, shard, zero.zero_hpz_partition_size, cfg.sequence_parallel_size, ep)
