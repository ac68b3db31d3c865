"""Offload's host copies (zero/host_copy.py, comm/host.py): on the CPU they reduce to today's plain copies, and an
offloaded run is bitwise repeatable (the GPU side, side stream and events, is gpu_check's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_cases import make_config

from shardwise.comm import Comm
from shardwise.comm.host import broadcast_through_device
from shardwise.zero.flat_group import ShardedGroup
from shardwise.zero.host_copy import accelerated, copy_ahead, fence, to_readable
from shardwise.zero.policy import GroupOptions, OffloadPolicy, ShardPolicy


def test_cpu_copies_are_plain_copies():
    """No stream, no event on the CPU: the same object where ``.to`` returns it, the same bits."""
    src = torch.randn(37)
    assert not accelerated(torch.device("cpu"))
    fence(torch.device("cpu"))  # a no-op, not an error
    assert to_readable(src, torch.device("cpu"), torch.float32) is src
    half = to_readable(src, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(half, src.to(torch.bfloat16))
    before = src.clone()
    broadcast_through_device(Comm(solo=True), src)
    assert torch.equal(src, before)
    fence(torch.device("cpu"), copies_too=True)
    dst = torch.empty(37)
    assert copy_ahead(dst, src) is None and torch.equal(dst, src)  # a prefetch's copy: in line, the same bits


def test_cpu_offload_group_takes_todays_path():
    """An offloaded group on the CPU makes no host staging buffer, and its master gradient is the
    owned gradient times the scale, bit for bit."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(6, 5))
    opts = GroupOptions(offload=OffloadPolicy(torch.device("cpu"), pin_memory=True))
    g = ShardedGroup([p], ["w"], Comm(solo=True), ShardPolicy.for_stage(2), opts)
    assert g.to_host is None and not g.master_is_view
    (p * torch.randn(6, 5)).sum().backward()
    g.end_backward()
    g.wait()
    want = g.owned_grad().clone() * 0.25
    g.start_master_grad()  # a no-op here
    got = g.attach_master_grad(0.25)
    assert got.device.type == "cpu" and torch.equal(got, want)


@pytest.mark.parametrize(("stage", "extra"), [(2, {}), (3, {"offload_param": {"device": "cpu", "pin_memory": True},
                                                           "stage3_param_persistence_threshold": 0})])
def test_offload_runs_are_bitwise_identical(pool2, stage, extra):
    """Two identical offloaded runs: equal losses and weights, bit for bit (torch.equal)."""
    cfg = make_config(stage, offload=True, **extra)
    first = pool2.run("zero_cases:train_ranks", "llama", cfg)
    second = pool2.run("zero_cases:train_ranks", "llama", cfg)
    for r in range(2):
        assert first[r]["losses"] == second[r]["losses"]
    a, b = first[0]["weights"], second[0]["weights"]
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_offload_changes_no_bit_on_cpu(pool2):
    """On the CPU the offloaded master steps with the same fused AdamW kernel on the same bits as the
    device-resident one: stage 2 with and without offload_optimizer give equal weights."""
    plain = pool2.run("zero_cases:train_ranks", "llama", make_config(2))
    off = pool2.run("zero_cases:train_ranks", "llama", make_config(2, offload=True))
    assert plain[0]["losses"] == off[0]["losses"]
    assert all(torch.equal(plain[0]["weights"][n], off[0]["weights"][n]) for n in plain[0]["weights"])


def test_comm_nccl_branches_equal_the_gloo_emulation(pool2):
    """Comm's NCCL-side code (emulation off) gives the gloo path's bits: two ranks' sums are one
    addition, so any order is exact; every rank's gathered buffer is every rank's data."""
    for rank, res in enumerate(pool2.run("nccl_path_cases:comm_both_branches")):
        for key, want in res[True].items():
            assert torch.equal(res[False][key], want), (rank, key)
        assert not torch.isnan(res[False]["reduce_scatter"]).any()


PARAM_OFFLOAD = {"offload_param": {"device": "cpu", "pin_memory": True}, "stage3_param_persistence_threshold": 0}


@pytest.mark.parametrize(("stage", "optimizer_offload", "extra"),
                         [(2, True, {}), (3, True, PARAM_OFFLOAD), (3, False, PARAM_OFFLOAD)])
def test_gpu_staging_path_changes_no_bit(pool2, stage, optimizer_offload, extra):
    """The step's GPU-side logic (every group's gradient staged in its host buffer, then waited,
    scaled and stepped; with parameter offload alone the master is the CPU shard itself) run on
    the CPU with no-op streams: the same bits as today's path."""
    cfg = make_config(stage, offload=optimizer_offload, **extra)
    plain = pool2.run("zero_cases:train_ranks", "llama", cfg)
    staged = pool2.run("nccl_path_cases:train_through_staging", "llama", cfg)
    assert staged[0]["staged"] > 0 and "staged" not in plain[0]
    assert plain[0]["losses"] == staged[0]["losses"]
    assert all(torch.equal(plain[0]["weights"][n], staged[0]["weights"][n]) for n in plain[0]["weights"])
