"""Small frozen policies a :class:`~shardwise.zero.flat_group.ShardedGroup` is built from.

The options of a ZeRO group are read once at the edge (the engine from the DeepSpeed config,
``shard()`` from its keywords) and passed down as a few immutable objects, as FSDP2 passes its
``MixedPrecisionPolicy`` / ``OffloadPolicy``: a group cannot change its mind halfway, every group
of one model shares the same objects, and code outside ``zero/`` asks the policy what is sharded
(``policy.shard_grads``) rather than comparing stage numbers. :class:`ShardPolicy` is the one
record of the ZeRO stage: ``engine.stage`` and ``Sharding.stage`` are derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardwise.comm import Comm
from shardwise.zero.gather_pool import GatherPool


@dataclass(frozen=True)
class ShardPolicy:
    """What a ZeRO stage shards (stage 0: nothing, DDP; each stage adds one kind of state)."""

    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool

    @classmethod
    def for_stage(cls, stage: int) -> ShardPolicy:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage: ZeRO stages are 0, 1, 2 and 3, got {stage!r}")
        return cls(shard_optimizer=stage >= 1, shard_grads=stage >= 2, shard_params=stage >= 3)

    @property
    def stage(self) -> int:
        """The ZeRO stage number this policy is (for messages, files and DeepSpeed's accessors)."""
        return int(self.shard_optimizer) + int(self.shard_grads) + int(self.shard_params)


@dataclass(frozen=True)
class OffloadPolicy:
    """Where the fp32 master and its optimizer state live: ``device`` None keeps them on the
    group's device; a CPU device is DeepSpeed's ``offload_optimizer`` (``pin_memory`` pins it)."""

    device: torch.device | None = None
    pin_memory: bool = False
    # NVMe offload: no master is made at the build; a stand-in (reads NaN) until the swapper makes each
    # group's, a piece at a time, straight into its swap file (``master_start``: what it is made from), so
    # the host never holds every master at once (docs/offload.md, "Host memory, bounded by construction")
    master_later: bool = False


@dataclass(frozen=True)
class PrecisionPolicy:
    """The optimizer steps on ``master_dtype``; gradients accumulate and are reduced in
    ``grad_dtype`` (None: the parameters' dtype; see ``zero/grad_accum.py``). A bf16/fp16
    ``master_dtype`` applies to the groups of that dtype (others keep fp32 masters): their optimizer
    state is kept in ``state_dtype`` and each update rounded by ``master_update``
    (``zero/low_precision.py``)."""

    master_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype | None = None
    state_dtype: torch.dtype = torch.float32
    master_update: str = "kahan"


@dataclass(frozen=True)
class CommPolicy:
    """How a group talks: ``overlap_comm`` runs its reductions asynchronously; ``weight_bits`` /
    ``grad_bits`` are ZeRO++'s quantized parameter gather (qwZ) and gradient reduce-scatter (qgZ),
    0 = exact. ``replicate``: the ranks holding the same shard in other shard groups (hybrid
    sharding); ``secondary``: a node's ranks for ZeRO++ hpZ's backward gathers."""

    overlap_comm: bool = False
    weight_bits: int = 0
    grad_bits: int = 0
    replicate: Comm | None = field(default=None, compare=False)
    secondary: Comm | None = field(default=None, compare=False)


@dataclass(frozen=True)
class GroupOptions:
    """Everything a group is built with besides its parameters, comm and :class:`ShardPolicy`:
    ``device`` (default: the parameters'), ``pool`` (buffers a frozen stage-3 group is gathered
    into) and the three policies above."""

    device: torch.device | None = None
    offload: OffloadPolicy = OffloadPolicy()
    precision: PrecisionPolicy = PrecisionPolicy()
    comm: CommPolicy = CommPolicy()
    pool: GatherPool | None = field(default=None, compare=False)


DEFAULT_GROUP_OPTIONS = GroupOptions()  # on the parameters' device, nothing offloaded, exact comm
