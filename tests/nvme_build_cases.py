"""Rank-side runs for the NVMe offload build (tests/test_nvme_build.py): no master is made whole on the
host before its swap file, each is made a piece at a time in a buffer, and an engine with no optimizer
still gets its masters (on the host, as CPU offload)."""

from __future__ import annotations

import tempfile

import torch
from nvme_cases import config
from tiny_models import build

import shardwise
from shardwise.nvme import OptimizerSwapper, is_stand_in


def build_makes_no_master(stage: int, precision: str, param_nvme: bool, sub_group_size: int) -> dict:
    """The groups as the swapper finds them (every trainable master still a stand-in: none was made whole),
    the largest host tensor the build's master pieces passed through (a buffer's view, never a group's
    master), and the files' masters read back against the model's weights (exactly their fp32 copy)."""
    root = tempfile.mkdtemp()
    cfg = config(stage, precision, "nvme", root, buffer_count=2)
    cfg["zero_optimization"]["sub_group_size"] = sub_group_size
    if param_nvme:
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, offload_param={
            "device": "nvme", "nvme_path": root, "buffer_count": 2, "buffer_size": 3000, "max_in_cpu": 0})
    seen: dict = {"fills": []}
    orig_open, orig_fill = OptimizerSwapper._open, OptimizerSwapper._fill

    def spy_open(self, settings):
        masters = [g.master for _, g in self.units]
        seen["stand_ins_at_open"] = all(is_stand_in(m) for m in masters)
        seen["pending"] = all(g.master_pending for _, g in self.units)
        return orig_open(self, settings)

    def spy_fill(self, u, buf, live):
        seen["fills"].append(all(is_stand_in(self.pieces[u].group.master) for u in range(len(self.pieces))))
        return orig_fill(self, u, buf, live)

    OptimizerSwapper._open, OptimizerSwapper._fill = spy_open, spy_fill
    try:
        engine, *_ = shardwise.initialize(model=build("llama"), config=cfg)
    finally:
        OptimizerSwapper._open, OptimizerSwapper._fill = orig_open, orig_fill
    with engine.nvme.resident(write_back=False):  # the files' masters, read back
        made = [g.master.clone() for _, g in engine.nvme.units]
    out = {**seen, "pieces": len(engine.nvme.pieces), "left_start": [g.master_start is not None
                                                                    for _, g in engine.nvme.units]}
    engine.destroy()
    cpu_cfg = config(stage, precision, "cpu")
    if param_nvme:
        cpu_cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, offload_param={"device": "cpu"})
    cpu, *_ = shardwise.initialize(model=build("llama"), config=cpu_cfg)  # CPU offload's masters, made whole
    ref = [g.master for g in cpu.sharding.groups if g.master is not None]
    out["same_as_cpu_offload"] = len(ref) == len(made) and all(
        m.dtype == r.dtype and torch.equal(m, r) for m, r in zip(made, ref, strict=True))
    cpu.destroy()
    return out


def no_optimizer_makes_masters_on_the_host(stage: int) -> dict:
    """``device: nvme`` with no optimizer: nothing swaps, so the masters are made on the host after all."""
    cfg = config(stage, "bf16", "nvme", tempfile.mkdtemp())
    del cfg["optimizer"]
    engine, *_ = shardwise.initialize(model=build("llama"), config=cfg)
    masters = [g.master for g in engine.sharding.groups if g.master is not None]
    out = {"nvme": engine.nvme is None, "real": [not is_stand_in(m) and bool(torch.isfinite(m).all()) for m in masters],
           "pending": [g.master_pending for g in engine.sharding.groups]}
    engine.destroy()
    return out
