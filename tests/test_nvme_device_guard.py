"""NVMe offload under the CPU-run device guard (tests/device_guard.py): the swap path with the parameters
on a second device, every tensor on its device and no host read of a copy in flight."""

from __future__ import annotations

import pytest
from device_guard import fake_world
from test_device_guard import config, train_steps

from shardwise.nvme import OptimizerSwapper


@pytest.fixture
def world2():
    with fake_world(2):
        yield


@pytest.mark.parametrize(("stage", "sub_group_size"), [(2, 1_000_000_000), (3, 1_000_000_000), (2, 64), (3, 64)])
def test_nvme_offload_steps_on_a_device(world2, tmp_path, monkeypatch, stage, sub_group_size):
    """The swap path's tensors (stand-ins, buffer views, the gradients from the device into the buffers,
    the step, the publish to the device, whole or by sub-group) under the guard; the file transfers are
    skipped (a fake tensor has no bytes: the guard's checkpoint tests skip them the same way),
    tests/test_nvme.py runs them for real."""
    monkeypatch.setattr(OptimizerSwapper, "_read", lambda self, u, buf: None)
    monkeypatch.setattr(OptimizerSwapper, "_write", lambda self, u, buf: None)
    cfg = config(stage, "bf16", offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path),
                                                    "pipeline_read": True, "pipeline_write": True})
    cfg["zero_optimization"]["sub_group_size"] = sub_group_size
    engine, guard = train_steps(cfg)
    assert engine.nvme is not None and all(g.master.device.type == "cpu" for g in engine.groups)
    assert (len(engine.nvme.pieces) > len(engine.nvme.units)) == (sub_group_size == 64)
    assert not guard.in_flight
    engine.destroy()


@pytest.mark.parametrize("opt", ["cpu", "nvme"])
def test_nvme_parameters_on_a_device(world2, tmp_path, monkeypatch, opt):
    """Parameters on NVMe under the guard at two (fake) ranks: the prefetch's read-then-all-gather, the
    step's hand-over of each new shard to the writer (a host copy of a device tensor), the gathers into the
    device buffer; the file transfers skipped as above (a fake tensor has no bytes). ``opt`` nvme: the
    build makes each master from its shard read back into a swap buffer (``OptimizerSwapper._made``)."""
    from shardwise.nvme import NvmeParamStore

    monkeypatch.setattr(OptimizerSwapper, "_read", lambda self, u, buf: None)
    monkeypatch.setattr(OptimizerSwapper, "_write", lambda self, u, buf: None)

    monkeypatch.setattr(NvmeParamStore, "reads_ahead_of_gather", True)  # the read-then-all-gather path too
    monkeypatch.setattr(NvmeParamStore, "_read", lambda self, dst: None)
    monkeypatch.setattr(NvmeParamStore, "_write", lambda self, src: None)
    cfg = config(3, "bf16", offload_param={"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0},
                 offload_optimizer={"device": opt, **({"nvme_path": str(tmp_path)} if opt == "nvme" else {})})
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, guard = train_steps(cfg)
    assert engine.nvme_params is not None and engine.nvme_params.waits["ahead"] > 0
    assert (engine.nvme is not None) == (opt == "nvme")
    assert not guard.in_flight
    engine.destroy()
