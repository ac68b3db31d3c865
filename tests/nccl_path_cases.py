"""Rank functions for tests/test_host_copy.py: Comm's NCCL-side branches run on gloo.

gloo (torch >= 2.13) serves ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, the calls Comm
makes on NCCL, so turning its gloo emulation off (``comm._emulate = False``) executes on a CPU the
code every NCCL job runs: the aliased and accumulating reduce-scatter's temporary and ``finish``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.comm import Comm


def comm_both_branches(numel: int = 12) -> dict[bool, dict[str, torch.Tensor]]:
    """Each collective Comm branches on, with the gloo emulation on (True) and off (False)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = numel // world
    data = torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))
    out = {}
    for emulate in (True, False):
        comm = Comm(None)
        comm._emulate = emulate  # False: the NCCL branch (dist's single-tensor collectives)
        gathered = data.clone()
        comm.all_gather(gathered)
        scattered = torch.full((shard,), float("nan"))
        comm.reduce_scatter(data.clone(), scattered)
        added = torch.ones(shard)
        work = comm.reduce_scatter(data.clone(), added, async_op=True, accumulate=True)
        work.wait()
        aliased = data.clone()
        comm.reduce_scatter(aliased, aliased.narrow(0, rank * shard, shard))
        summed = data.clone()
        comm.all_reduce_in_rank_order(summed)
        out[emulate] = {"all_gather": gathered, "reduce_scatter": scattered, "accumulate": added,
                        "aliased": aliased.narrow(0, rank * shard, shard).clone(), "all_reduce": summed}
    return out


def train_through_staging(kind: str, config: dict) -> dict:
    """``zero_cases.train_ranks`` with every offloaded group on the GPU code path of the step:
    ``GradToHost`` staging (start every group's copy, then wait and scale) with the stream and
    its events stood in by no-ops, since a CPU build has none. Returns how many copies were staged."""
    import contextlib
    from unittest import mock

    from zero_cases import train_ranks

    from shardwise.zero.host_copy import GradToHost

    class NoStream(contextlib.nullcontext):
        def wait_stream(self, other: object) -> None:
            pass

    start = mock.patch.object(GradToHost, "start", autospec=True, side_effect=GradToHost.start)
    with (mock.patch("shardwise.zero.flat_group.accelerated", return_value=True),
          mock.patch("shardwise.zero.host_copy.side_stream", return_value=NoStream()),
          mock.patch("torch.accelerator.current_stream", return_value=None), start as started):
        res = train_ranks(kind, config)
    res["staged"] = started.call_count
    return res
