"""A Megatron-style ``mpu`` for a sequence-parallel run (what DeepSpeed's ``register_with_transformers`` returns).

``shardwise.initialize(mpu=...)`` recognises it and runs sequence parallelism over its groups
(ZeRO over every rank, the batch rule over the data-parallel replicas); the groups answer the
names DeepSpeed's ``parallel_state_sp`` module has, which the HF Trainer and Accelerate read.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from shardwise.sequence_parallel.group import SequenceParallel


class SequenceParallelMPU:
    """The groups of one :class:`SequenceParallel`, under DeepSpeed's and Megatron's method names."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    # sequence parallel: the ranks sharing one sequence
    def get_sequence_parallel_group(self) -> Any:
        return self.sp.group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp.size

    def get_sequence_parallel_rank(self) -> int:
        return self.sp.rank

    # data parallel: the replicas reading different samples (one rank of each SP group)
    def get_data_parallel_group(self) -> Any:
        return self.sp.mesh.data.group

    def get_data_parallel_world_size(self) -> int:
        return self.sp.data_world

    def get_data_parallel_rank(self) -> int:
        return self.sp.data_rank

    # sequence x data parallel: every rank (ZeRO's group)
    def get_sequence_data_parallel_group(self) -> Any:
        return None

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    # no model parallelism
    def get_model_parallel_group(self) -> Any:
        return None

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0
