"""Stage 3 lets go of its 16-bit gradient shards as FSDP2 frees its gradients (docs/precision.md, "The peak
of a step"): exact byte counts from the model's sizes, and the same bits as when the shards were kept."""

from __future__ import annotations

import pytest
from zero_cases import assert_same_bits


@pytest.mark.parametrize(("overlap", "gas"), [(False, 1), (True, 2)])
def test_stage3_holds_a_16bit_grad_shard_only_from_its_reduction_to_its_upcast(pool2, overlap, gas):
    res = pool2.run("grad_release_cases:release_sequence", overlap, gas)
    for r in res:
        n = r["numels"]
        for step in r["steps"]:
            # backward: a group's shard appears at its own reduce-scatter, after those reduced before it
            first = step["before_reduce"][:len(n)]
            assert sorted(i for i, _ in first) == list(range(len(n)))
            for k, (_, held) in enumerate(first):
                assert held == 2 * sum(n[j] for j, _ in first[:k]), (k, first)
            assert step["after_backward"] == 2 * sum(n)
            # step: after group i's upcast, groups > i hold their 16-bit shard and groups <= i their fp32 grad
            assert [i for i, _, _ in step["after_upcast"]] == list(range(len(n)))
            for i, bf16, fp32 in step["after_upcast"]:
                assert (bf16, fp32) == (2 * sum(n[i + 1:]), 4 * sum(n[:i + 1])), (i, bf16, fp32)
            assert step["after_step"] == 0 and step["report_grads"] == 0
        assert r["read_after_step_zero"]  # DeepSpeed's getter between steps reads zeros, not None


@pytest.mark.parametrize(("precision", "overlap", "gas"), [("bf16", True, 2), ("fp32", False, 1)])
def test_stage3_grad_release_changes_no_bit(pool2, precision, overlap, gas):
    kept = pool2.run("grad_release_cases:train", False, overlap, gas, precision)
    assert_same_bits(kept, pool2.run("grad_release_cases:train", True, overlap, gas, precision))
