"""``PipelineModule``: a sequence of layers cut into stages, each rank building only its stage's layers.

DeepSpeed's constructor, arguments and numbering: ``layers`` (modules, ``LayerSpec``s,
``TiedLayerSpec``s or plain callables) is cut by ``partition_method`` into ``num_stages`` contiguous
runs (``parts``); this rank builds the run of its stage in order, drawing its random numbers as
DeepSpeed draws them (the ``parameters`` method first builds each spec once to count it), so with
``seed_layers=True`` a layer's initial weights do not depend on the number of stages. Its
``forward`` runs the local layers, in chunks of ``activation_checkpoint_interval`` layers under
activation checkpointing when that is above 0 (``activation_checkpoint_func`` when given, else
``torch.utils.checkpoint``, non-reentrant: the same gradients, the forward recomputed in backward).
The schedule and the transfers between stages are the engine's (``pipeline/engine.py``).
"""

from __future__ import annotations

import functools
import random
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.engine.compat import UsageError
from shardwise.pipeline.spec import LayerSpec, TiedLayerSpec, partition_layers
from shardwise.pipeline.topology import (
    GRID_ORDERS,
    PipeDataParallelTopology,
    PipelineParallelGrid,
    ProcessTopology,
    set_current_grid,
)


def set_random_seed(seed: int) -> None:
    """DeepSpeed's default ``seed_fn`` (and ``deepspeed.runtime.utils.set_random_seed``, which DeepSpeed's
    pipeline example calls): Python's, NumPy's (when installed) and torch's generators."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # NumPy is optional here
        numpy = None
    if numpy is not None:
        numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def _topology(num_stages: int | None, topology: ProcessTopology | None) -> ProcessTopology:
    if topology is not None:
        if topology.get_dim("model") > 1 and topology.axes not in GRID_ORDERS:
            raise UsageError(f"PipelineModule(topology=...): a model-parallel size of {topology.get_dim('model')} is "
                             f"served with the axes ordered pipe, data, model (PipeModelDataParallelTopology), not "
                             f"{', '.join(topology.axes)}")
        return topology
    if num_stages is None:
        raise UsageError("PipelineModule() needs num_stages or topology")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if int(num_stages) < 1 or world % int(num_stages):
        raise UsageError(f"PipelineModule(num_stages={num_stages}) must divide the world size {world}")
    return PipeDataParallelTopology(num_pp=int(num_stages), num_dp=world // int(num_stages))


class PipelineModule(nn.Module):
    """Layers to train with pipeline parallelism; this rank holds its stage's (DeepSpeed's API)."""

    def __init__(self, layers: Any, num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Any = None, seed_layers: bool = False, seed_fn: Any = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Any = None, checkpointable_layers: list[str] | None = None,
                 dynamic_shape: bool = False, virtual_stages: int = 1):
        super().__init__()
        if not dist.is_initialized():
            raise UsageError("PipelineModule() needs the process group: call deepspeed.init_distributed() "
                             "(shardwise.init_distributed()) first")
        self.loss_fn, self.seed_layers, self.seed_fn, self.base_seed = loss_fn, seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers, self.dynamic_shape = checkpointable_layers, dynamic_shape
        self.micro_offset = 0
        self._topo = _topology(num_stages, topology)
        self.num_stages = self._topo.get_dim("pipe")
        self._grid = PipelineParallelGrid(self._topo)
        set_current_grid(self._grid)  # its layers may read their tensor-parallel group while being built
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.stage_id = self._grid.get_stage_id()
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        if self._num_layers < self.num_stages:
            raise UsageError(f"PipelineModule: {self.num_stages} stages but only {self._num_layers} layers; "
                             "give at least one layer per stage")
        self.virtual_stages = self._virtual(virtual_stages)
        self.parts = partition_layers(self._layer_specs, self.num_stages * self.virtual_stages, partition_method)
        # (global start, global stop) of each chunk this rank holds: virtual stage c * p + s (interleaved)
        self.chunk_ranges = [(self.parts[c * self.num_stages + self.stage_id],
                              self.parts[c * self.num_stages + self.stage_id + 1]) for c in range(self.virtual_stages)]
        self._local_start, self._local_stop = self.chunk_ranges[0][0], self.chunk_ranges[-1][1]
        self.chunk_funcs: list[tuple[int, int]] = []  # each chunk's slice of forward_funcs
        self.forward_funcs: list[Any] = []
        self.fwd_map: dict[str, int] = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._build()

    def _seed(self, seed: int) -> None:
        (self.seed_fn or set_random_seed)(seed)

    def _virtual(self, v: int) -> int:
        """Chunks per rank (``pipeline.schedule: interleaved_1f1b``); a tied module is built once per rank
        and shared by its chunks (``pipeline/tied.py`` sums the gradients over ranks and chunks)."""
        v = int(v)
        if v < 1 or self._num_layers < self.num_stages * v:
            raise UsageError(f"PipelineModule(virtual_stages={v}): needs 1 <= virtual_stages and at least "
                             f"stages x virtual_stages = {self.num_stages * max(v, 1)} layers ({self._num_layers})")
        return v

    def _build(self) -> None:
        for start, stop in self.chunk_ranges:
            first = len(self.forward_funcs)
            self._build_range(start, stop)
            self.chunk_funcs.append((first, len(self.forward_funcs)))

    def _build_range(self, start: int, stop: int) -> None:
        for idx in range(start, stop):
            layer = self._layer_specs[idx]
            if self.seed_layers:
                self._seed(self.base_seed + idx)
            if isinstance(layer, PipelineModule):
                raise UsageError("a PipelineModule inside a PipelineModule's layers is not served")
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                self.forward_funcs.append(module if layer.forward_fn is None
                                          else functools.partial(layer.forward_fn, module))
                continue
            module = layer.build() if isinstance(layer, LayerSpec) else layer
            if isinstance(module, nn.Module):
                self.fwd_map[str(idx)] = len(self.forward_funcs)
                self.add_module(str(idx), module)
            self.forward_funcs.append(module)

    def use_topology(self, topology: ProcessTopology, mesh: Any = None) -> None:
        """Re-cut the grid for ``topology`` (same stages: a model axis added, for a model split over its
        tensor-parallel groups before it was cut; ``mesh``: those groups, ``layout.get_mesh``'s)."""
        if topology.get_dim("pipe") != self.num_stages or topology.world_size() != self.world_size:
            raise UsageError(f"use_topology: {topology.dims} does not keep {self.num_stages} stages of "
                             f"{self.world_size} ranks")
        self._topo, self._grid = topology, PipelineParallelGrid(topology, mesh)

    # -- DeepSpeed's accessors ----------------------------------------------------------
    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def partitions(self) -> list[int]:
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise UsageError(f"stage_owner({layer_idx}): there are {self._num_layers} layers")
        virtual = next(s for s in range(len(self.parts) - 1) if self.parts[s] <= layer_idx < self.parts[s + 1])
        return virtual % self.num_stages

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise UsageError(f"set_checkpoint_interval({interval}): the interval must be >= 0")
        self.activation_checkpoint_interval = int(interval)

    def get_additional_losses(self) -> None:
        return None

    def tied_keys(self) -> list[str]:
        """Every TiedLayerSpec key of the whole model, sorted (the same order on every rank)."""
        return sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})

    def tied_layers(self, key: str) -> list[int]:
        """The global indices of the layers that use ``key``."""
        return [i for i, s in enumerate(self._layer_specs) if isinstance(s, TiedLayerSpec) and s.key == key]

    def tied_stages(self, key: str) -> list[int]:
        """The stages holding a use of ``key``, in order."""
        return sorted({self.stage_owner(i) for i in self.tied_layers(key)})

    def tied_weights(self, key: str) -> list[torch.Tensor]:
        """The tied tensors of this stage's copy of ``key`` (``tied_weight_attr``, dotted paths allowed)."""
        out = []
        for attr in self.tied_weight_attrs[key]:
            obj: Any = self.tied_modules[key]
            for part in attr.split("."):
                obj = getattr(obj, part)
            out.append(obj)
        return out

    # -- forward ---------------------------------------------------------------------------
    def _run(self, start: int, stop: int, offset: int, layer0: int, *inputs: Any) -> Any:
        x = inputs[0] if len(inputs) == 1 else inputs
        for i, layer in enumerate(self.forward_funcs[start:stop]):
            if self.seed_layers:  # DeepSpeed's per-micro-batch seed (its layer index counts from the chunk start)
                self._seed(self.base_seed * offset + i + layer0)
            x = layer(x)
        return x

    def forward(self, forward_input: Any, chunk: int = 0, micro_offset: int | None = None) -> Any:
        """This rank's layers (chunk ``chunk`` of them with virtual stages) on ``forward_input``;
        ``micro_offset``: the micro-batch's seed offset (interleaved: one per micro-batch, not per call)."""
        if micro_offset is None:
            self.micro_offset += 1
            micro_offset = self.micro_offset
        offset = micro_offset + 1
        first, n = self.chunk_funcs[chunk]
        layer0 = self.chunk_ranges[chunk][0]
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._run(first, n, offset, layer0, forward_input)
        x = forward_input
        for start in range(first, n, interval):
            stop = min(start + interval, n)
            args = x if isinstance(x, tuple) else (x,)
            if self.training and self._checkpointable(start, stop):
                run = functools.partial(self._run, start, stop, offset, layer0)
                x = (self.activation_checkpoint_func(run, *args) if self.activation_checkpoint_func is not None
                     else checkpoint(run, *args, use_reentrant=False))
            else:
                x = self._run(start, stop, offset, layer0, *args)
        return x

    def _checkpointable(self, start: int, stop: int) -> bool:
        """DeepSpeed's rule: a chunk is checkpointed when a layer in it has parameters (or, with
        ``checkpointable_layers``, is of a listed class)."""
        funcs = self.forward_funcs[start:stop]
        if self.checkpointable_layers is not None:
            return any(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and next(f.parameters(), None) is not None for f in funcs)
