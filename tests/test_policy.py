"""The frozen policies are the one record of the ZeRO stage; the one accessor and Comm factory."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from shardwise.comm import make_comm
from shardwise.inference import memory_report, stream_state_of
from shardwise.zero.policy import DEFAULT_GROUP_OPTIONS, ShardPolicy


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_round_trips_through_the_policy(stage: int) -> None:
    policy = ShardPolicy.for_stage(stage)
    assert policy.stage == stage
    assert (policy.shard_optimizer, policy.shard_grads, policy.shard_params) == (stage >= 1, stage >= 2, stage >= 3)


def test_policies_are_frozen_and_bad_stages_refused() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ShardPolicy.for_stage(1).shard_grads = True  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_GROUP_OPTIONS.device = None  # type: ignore[misc]
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        ShardPolicy.for_stage(4)


def test_a_resident_model_has_no_stream_state() -> None:
    model = nn.Linear(2, 2)
    assert stream_state_of(model) is None
    with pytest.raises(ValueError, match="not streamed"):
        memory_report(model)


def test_make_comm_solo_forms() -> None:
    for comm in (make_comm("solo"), make_comm(object(), size=1)):
        assert (comm.size, comm.rank) == (1, 0)
