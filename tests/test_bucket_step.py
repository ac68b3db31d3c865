"""Stages 1-2 step bucket by bucket, each bucket's all-gather overlapping the next one's step
(shardwise/zero/bucket_step.py): bit-identical to one whole optimizer step followed by the gathers.

Bit-exact is the right bound: the per-bucket path runs the same elementwise kernels on the same
tensors, only in other calls. Weights are read straight after every step() (every rank's range must
be fresh), and the optimizer state_dict (layout, state, LR written by the scheduler) must be equal too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

CASES = [  # (front end, stage, optimizer, extra)
    ("engine", 1, "adamw", {}),
    ("engine", 2, "adamw_fused", {}),
    ("engine", 2, "sgd_momentum", {"precision": "bf16"}),
    ("engine", 2, "adamw", {"offload": True}),
    ("shard", 1, "adamw_fused", {}),
    ("shard", 2, "sgd_momentum", {}),
]


def _assert_identical(a: Any, b: Any, where: str = "") -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize(("front", "stage", "opt", "extra"), CASES)
def test_per_bucket_step_bit_identical_to_one_step(pool2, front, stage, opt, extra):
    target = "bucket_step_cases:engine_run" if front == "engine" else "bucket_step_cases:shard_api_run"
    overlapped = pool2.run(target, stage, opt, False, **extra)
    one_step = pool2.run(target, stage, opt, True, **extra)
    for rank, (got, want) in enumerate(zip(overlapped, one_step, strict=True)):
        assert got["per_bucket"] and not want["per_bucket"]
        assert got["buckets"] >= 2  # else there is nothing to overlap
        _assert_identical(got["after_step"], want["after_step"], f"rank {rank} weights after step")
        _assert_identical(got["state"], want["state"], f"rank {rank} optimizer state_dict")
        _assert_identical(got["lr"], want["lr"], f"rank {rank} lr")
    for step in range(len(overlapped[0]["after_step"])):  # every rank sees the same (fresh) weights
        _assert_identical(overlapped[0]["after_step"][step], overlapped[1]["after_step"][step], f"step {step}")
