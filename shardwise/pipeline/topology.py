"""DeepSpeed's process topologies and the pipeline grid (``engine.grid``): which rank is which stage.

A topology names its axes (``pipe``, ``data``, ``model``) and their sizes; ranks are numbered in
row-major order over the axes as listed, the last axis fastest, as DeepSpeed numbers them, so a
script that computes a peer's rank from coordinates gets the same answer. With
``PipeDataParallelTopology(num_pp=2, num_dp=2)`` ranks 0 and 1 are stage 0 (data ranks 0 and 1),
ranks 2 and 3 stage 1.

:class:`PipelineParallelGrid` holds this rank's groups: one pipeline group per position inside a stage
(the stages a micro-batch passes through: the same data, sequence and model coordinate in each), one
data-parallel group per stage and model rank (the replicas whose gradients are averaged) and the
model-parallel (tensor-parallel) group. For DeepSpeed's own orders (``pipe, data`` and ``pipe, data,
model``: stages outermost, model innermost) every group is the run layout's (``layout/grid.py``: one
rank grid, pp x dp x (sp x) tp), the same groups the stage's engine, ZeRO and sequence parallelism get;
a topology in another order cuts its own groups here and serves pipeline x data parallelism only.
Groups are made with the job's timeout.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any

import torch.distributed as dist

from shardwise.comm import Comm, collective_timeout
from shardwise.layout import Mesh, SequenceMesh, get_mesh, get_pipe_group


class ProcessTopology:
    """Maps n-dimensional coordinates (one per axis) to linear ranks and back (DeepSpeed's API)."""

    def __init__(self, axes: list[str], dims: list[int]):
        if len(axes) != len(dims) or any(int(d) < 1 for d in dims):
            raise ValueError(f"ProcessTopology(axes={axes}, dims={dims}): one positive size per axis")
        self.axes, self.dims = list(axes), [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping = {self.ProcessCoord(*c): r
                        for r, c in enumerate(itertools.product(*(range(d) for d in self.dims)))}

    def get_rank(self, **coord_kwargs: int) -> int:
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank() needs every axis {self.axes}, got {sorted(coord_kwargs)}")
        return self.mapping[self.ProcessCoord(**coord_kwargs)]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_rank_repr(self, rank: int, omit_axes: tuple = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in omit_axes)

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} is not in this topology of {self.world_size()} ranks")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Every group of ranks that differ only along ``axis`` (each sorted), in DeepSpeed's order."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for rest in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, rest, strict=True))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        return [r for c, r in self.mapping.items()
                if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        if axis not in self.axes:
            return []
        i = self.axes.index(axis)
        return sorted(r for c, r in self.mapping.items() if c[i] == idx)

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: stages outermost, so a stage's data-parallel ranks are consecutive."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism, DeepSpeed's 3D layout: rank ``(pipe * num_dp + data) *
    num_mp + model``, the run layout's order (``layout/grid.py``)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


_MADE: dict[Any, Any] = {"world": None}  # groups made in this process group, by their ranks (reused)
_BUILDING: dict[str, Any] = {"grid": None}  # the grid of the PipelineModule built last (current_grid())
GRID_ORDERS = (["pipe", "data"], ["pipe", "data", "model"])  # the run layout's orders (stages outermost)


def current_grid() -> PipelineParallelGrid | None:
    """The grid of the ``PipelineModule`` being (or last) built on this rank: what a layer split over the
    model-parallel (or sequence-parallel) group reads while its ``LayerSpec`` is built, as Megatron's
    layers read its ``mpu``. None before any ``PipelineModule``."""
    return _BUILDING["grid"]


def set_current_grid(grid: PipelineParallelGrid) -> None:
    _BUILDING["grid"] = grid


def _groups(lists: list[list[int]], rank: int) -> tuple[Any, list[int]]:
    """Make one group per list (collective: every rank, same order; made once per set of ranks for
    the process's life, as the layout's groups are); this rank's group and ranks."""
    if _MADE["world"] is not dist.group.WORLD:  # a new default group: the old groups are gone with it
        _MADE.clear()
        _MADE["world"] = dist.group.WORLD
    mine, ranks = None, []
    for members in lists:
        key = tuple(members)
        if key not in _MADE:
            _MADE[key] = dist.new_group(members, timeout=collective_timeout())
        g = _MADE[key]
        if rank in members:
            mine, ranks = g, members
    return mine, ranks


class PipelineParallelGrid:
    """This rank's place in the topology and its groups (DeepSpeed's ``engine.grid`` / ``module._grid``)."""

    def __init__(self, topology: ProcessTopology, mesh: Mesh | None = None):
        """``mesh``: the stage's groups already cut (``layout.get_mesh(tp, pp=stages)``) for a model split
        over them; None: cut (or found) here."""
        self._topo = topology
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if topology.world_size() != self.world_size:
            raise ValueError(f"the pipeline topology has {topology.world_size()} ranks ({topology.axes} = "
                             f"{topology.dims}) but the world has {self.world_size}")
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = topology.get_coord(self.global_rank)
        self.stage_id = coord.pipe
        self.data_parallel_id = coord.data
        self.model_parallel_id = getattr(coord, "model", 0)
        self.on_layout = topology.axes in GRID_ORDERS  # the run layout's groups (module docstring)
        self.mesh: Mesh | None = None  # the stage's groups (on the layout)
        self.sequence: SequenceMesh | None = None  # SP's groups, set by the stage's engine (build.py)
        if self.on_layout:
            self.pp_group_handle, self.pp_group = get_pipe_group(self.pipe_parallel_size)
            self.mesh = mesh if mesh is not None else get_mesh(self.model_parallel_size, pp=self.pipe_parallel_size)
            self.dp_group_handle = self._handle(self.mesh.dp_full, topology.get_axis_comm_lists("data"))
            self.mp_group_handle = self._handle(self.mesh.tp, topology.get_axis_comm_lists("model"))
        else:
            self.pp_group_handle, self.pp_group = _groups(topology.get_axis_comm_lists("pipe"), self.global_rank)
            self.dp_group_handle, _ = _groups(topology.get_axis_comm_lists("data"), self.global_rank)
            self.mp_group_handle = None
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1

    def _handle(self, comm: Comm, lists: list[list[int]]) -> Any:
        """A process group for DeepSpeed's getters: the layout's own, the world's, or (a group of one,
        which the layout leaves as no group) one made here."""
        if comm.group is not None:
            return comm.group
        if comm.size == self.world_size:
            return dist.group.WORLD
        return _groups(lists or [[r] for r in range(self.world_size)], self.global_rank)[0]

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def get_global_rank(self) -> int:
        return self.global_rank

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of ``stage_id`` at this rank's other coordinates (or those given)."""
        coord = self._topo.get_coord(self.global_rank)._asdict()
        coord.update(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord)

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_group_handle

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_group_handle

    def get_model_parallel_rank(self) -> int:
        return self.model_parallel_id

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_group(self) -> Any:
        return self.mp_group_handle

    def get_slice_parallel_rank(self) -> int:
        return self.model_parallel_id

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.mp_group_handle

    # -- shardwise's: the groups as counted comms (a layer split over them calls these in its forward) --
    def tp_comm(self) -> Comm:
        """The model-parallel group as the run layout's :class:`Comm` (its traffic counts in the stage
        engine's ``comm_stats()`` once the engine is built)."""
        if self.mesh is None:
            raise ValueError(f"a topology ordered {self._topo.axes} has no tensor-parallel group here; use "
                             "PipeModelDataParallelTopology (pipe, data, model)")
        return self.mesh.tp

    def sp_comm(self) -> Comm:
        """The sequence-parallel group (the config's ``sequence_parallel_size``), once the engine is built."""
        if self.sequence is None:
            raise ValueError("no sequence-parallel group: set sequence_parallel_size > 1 in the config and "
                             "call initialize() before the first forward")
        return self.sequence.sp

    def get_sequence_parallel_group(self) -> Any:
        return self.sp_comm().group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sequence.sp.size if self.sequence is not None else 1

    def get_sequence_parallel_rank(self) -> int:
        return self.sequence.sp.rank if self.sequence is not None else 0
