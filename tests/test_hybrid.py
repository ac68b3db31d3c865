"""Hybrid sharding (shard within k ranks, replicate across) against single-process PyTorch, 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from test_zero import _check_equivalent
from zero_cases import make_config, reference


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shard2_replicate2_matches_single_process(pool4, stage):
    cfg = make_config(stage, dp=4, mics_shard_size=2)
    res = pool4.run("zero_cases:train_ranks", "llama", cfg)
    _check_equivalent(res, reference("llama", cfg, world=4))


def test_stage3_only_the_gradient_shard_crosses_groups(pool4):
    """Per step the replicas exchange one all-reduce of the shard (2Ψ/k bytes counted per rank)."""
    steps = 3
    shard_all = {"stage3_param_persistence_threshold": 0}  # tiny params would otherwise stay whole
    hybrid = pool4.run("zero_cases:train_ranks", "llama", make_config(3, dp=4, mics_shard_size=2, **shard_all),
                       steps=steps)
    plain = pool4.run("zero_cases:train_ranks", "llama", make_config(3, dp=4, **shard_all), steps=steps)
    numel = hybrid[0]["numel"]
    across = hybrid[0]["comm"]["all_reduce_across_groups"] / steps
    assert across == pytest.approx(2 * numel * 4 / 2, rel=0.02)  # fp32, k = 2; padding only
    inside = sum(hybrid[0]["comm"][k] for k in ("all_gather", "reduce_scatter")) / steps
    plain_dp = sum(plain[0]["comm"][k] for k in ("all_gather", "reduce_scatter")) / steps
    assert inside == pytest.approx(plain_dp, rel=0.02)  # the same 3Ψ, now inside a group of 2
    assert "all_reduce_across_groups" not in plain[0]["comm"] or plain[0]["comm"]["all_reduce_across_groups"] == 0
    mem_h, mem_p = hybrid[0]["memory"], plain[0]["memory"]
    assert mem_h["params"] == pytest.approx(2 * mem_p["params"], rel=0.05)  # 16Ψ/k with k = N/2


def test_tp2_with_replicas_matches_single_process(pool4):
    cfg = make_config(2, dp=2, tp=2, mics_shard_size=1)
    res = pool4.run("zero_cases:train_ranks", "llama", cfg)
    _check_equivalent(res, reference("llama", cfg, world=2), tp=2)


def test_stage0_with_a_shard_group_is_refused(pool2):
    from rank_pool import RankError

    with pytest.raises(RankError, match="mics_shard_size"):
        pool2.run("zero_cases:train_ranks", "llama", make_config(0, mics_shard_size=1))


def test_checkpoints_cross_between_hybrid_and_plain(pool2, pool4, tmp_path):
    """World 2 stage 2 -> world 4 stage 3 with k = 2 (resumes the same run) -> back to world 2."""
    from ckpt_cases import STEPS
    from test_checkpoint import CROSS_TOL, KIND, _mean_losses

    base = pool2.run("ckpt_cases:train_and_save", KIND, 2, str(tmp_path / "ckpt"), str(tmp_path / "hf16"))
    hybrid = pool4.run("ckpt_cases:load_and_train", KIND, 3, str(tmp_path / "ckpt"),
                       cfg_kw={"mics_shard_size": 2}, save_to=str(tmp_path / "again"))
    assert _mean_losses(hybrid) == pytest.approx(_mean_losses(base)[STEPS // 2:], rel=CROSS_TOL)
    back = pool2.run("ckpt_cases:load_and_train", KIND, 2, str(tmp_path / "again"))
    assert back[0]["start"] == STEPS and back[0]["weights"].keys() == base[0]["weights"].keys()
    for name, w in back[0]["weights"].items():  # hybrid wrote each shard once; nothing lost or doubled
        assert torch.allclose(w, hybrid[0]["weights"][name], rtol=0, atol=0), name


@pytest.mark.parametrize("gas", [1, 2])
def test_hpz_matches_single_process(pool4, gas):
    cfg = make_config(3, dp=4, gas=gas, zero_hpz_partition_size=2)
    res = pool4.run("zero_cases:train_ranks", "llama", cfg)
    _check_equivalent(res, reference("llama", cfg, world=4))


def test_hpz_backward_gathers_stay_in_the_node(pool4):
    """hpZ: forward gathers over all 4 ranks, backward from the secondary shards of 2 ranks."""
    shard_all = {"stage3_param_persistence_threshold": 0}
    hpz = pool4.run("zero_cases:train_ranks", "llama", make_config(3, dp=4, zero_hpz_partition_size=2, **shard_all))
    plain = pool4.run("zero_cases:train_ranks", "llama", make_config(3, dp=4, **shard_all))
    got, base = hpz[0]["comm"], plain[0]["comm"]
    # plain: one forward and one backward gather per step over every rank; hpZ moves the backward
    # half into the node, as secondary all-gathers of the same size
    assert got["all_gather"] == pytest.approx(base["all_gather"] / 2, rel=0.02)
    assert got["all_gather_secondary"] == pytest.approx(base["all_gather"] / 2, rel=0.02)
    assert got["reduce_scatter"] == base["reduce_scatter"]
    assert hpz[0]["memory"]["params"] == plain[0]["memory"]["params"]  # secondary shards freed by the step


def test_hpz_below_stage3_is_refused(pool2):
    from rank_pool import RankError

    with pytest.raises(RankError, match="zero_hpz_partition_size"):
        pool2.run("zero_cases:train_ranks", "llama", make_config(2, zero_hpz_partition_size=2))
