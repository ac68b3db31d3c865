"""Top-level dotted keys (``"zero_optimization.reduce_bucket_size": n``), as TRL's prepare_deepspeed
writes them: dropped with one warning where DeepSpeed's silent drop cannot change the numbers,
refused where it would, and refused as unknown where they name no key (config/dotted.py)."""

from __future__ import annotations

import logging

import pytest

from shardwise.config import load_config
from shardwise.config.schema import ConfigError, SupportedFeatures

S3 = SupportedFeatures(stage3=True)
BASE = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "reduce_bucket_size": 4096}}
H = 64
TRL = {  # trl.models.utils.prepare_deepspeed, hidden size 64
    "zero_optimization.reduce_bucket_size": H * H,
    "zero_optimization.stage3_param_persistence_threshold": 10 * H,
    "zero_optimization.stage3_prefetch_bucket_size": 0.9 * H * H,
}


def test_trl_keys_are_dropped_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        cfg = load_config({**BASE, **TRL}, supported=S3)
    ref = load_config(BASE, supported=S3)
    assert cfg.zero_optimization == ref.zero_optimization  # as DeepSpeed: nothing applied
    warned = [r.getMessage() for r in caplog.records if "dotted" in r.getMessage()]
    assert len(warned) == 1 and all(k in warned[0] for k in TRL)


@pytest.mark.parametrize("extra", [{"zero_optimization.stage": 3}, {"tensorboard.enabled": True},
                                   {"zero_optimization.contiguous_gradients": False},
                                   {"zero_optimization.stage3_max_live_parameters": 7}])
def test_dotted_keys_that_change_nothing_are_dropped(extra):
    assert load_config({**BASE, **extra}, supported=S3).zero_optimization.stage == 3


@pytest.mark.parametrize("extra, nested", [
    ({"bf16.enabled": True}, '{"bf16": {"enabled": true}}'),
    ({"zero_optimization.stage": 2}, '{"zero_optimization": {"stage": 2}}'),
    ({"gradient_clipping": 1.0, "optimizer.type": "SGD"}, '{"optimizer": {"type": "SGD"}}'),
])
def test_dotted_keys_that_change_training_are_refused(extra, nested):
    with pytest.raises(ConfigError, match="DeepSpeed ignores") as err:
        load_config({**BASE, **extra}, supported=S3)
    assert nested in str(err.value) and "\n" not in str(err.value)


def test_bucket_size_is_refused_when_quantized_gradients_use_it():
    zero = {**BASE["zero_optimization"], "zero_quantized_gradients": True}
    with pytest.raises(ConfigError, match="zero_optimization.reduce_bucket_size"):
        load_config({**BASE, "zero_optimization": zero, "zero_optimization.reduce_bucket_size": 5}, supported=S3)
    zero = {**BASE["zero_optimization"], "zero_quantized_weights": True}
    with pytest.raises(ConfigError, match="stage3_param_persistence_threshold"):
        load_config({**BASE, "zero_optimization": zero,
                     "zero_optimization.stage3_param_persistence_threshold": 5}, supported=S3)


def test_dotted_keys_naming_nothing_stay_unknown():
    with pytest.raises(ConfigError, match="zero_optimization.no_such_key: unknown key"):
        load_config({**BASE, "zero_optimization.no_such_key": 1}, supported=S3)
