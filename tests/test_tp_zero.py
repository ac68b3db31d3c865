"""Tensor parallelism inside the training engine, alone and with ZeRO over the data-parallel group."""

from __future__ import annotations

import pytest
from test_zero import _check_equivalent
from zero_cases import make_config, reference


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_tp2_engine_matches_single_process(pool2, kind):
    cfg = make_config(0, tp=2, dp=1, clip=0.05)
    res = pool2.run("zero_cases:train_ranks", kind, cfg)
    _check_equivalent(res, reference(kind, cfg, world=1), tp=2)


@pytest.mark.parametrize("stage", [2, 3])
def test_tp2_times_dp2_with_zero(pool4, stage):
    cfg = make_config(stage, tp=2, dp=2, micro=1, clip=0.05, stage3_param_persistence_threshold=0)
    res = pool4.run("zero_cases:train_ranks", "llama", cfg)
    _check_equivalent(res, reference("llama", cfg, world=2), tp=2)
    # ZeRO shards what TP left: at stage 3 a rank holds 16 bytes x (its TP-local params) / dp, of which
    # the 4 bytes of gradient are let go at the step
    if stage == 3:
        m, local_psi = res[0]["memory"], res[0]["numel"]
        states = m["params"] + m["grads"] + m["master_params"] + m["optimizer_states"]
        assert m["grads"] == 0 and states == pytest.approx(12 * local_psi / 2, rel=0.02)
        assert local_psi < 0.55 * 126_912  # TP=2 left this rank about half of the tiny Llama
