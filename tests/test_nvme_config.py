"""NVMe offload's keys: the aio section mapped (thread_count and intra_op_parallelism both), bad values and
bad paths refused before training, naming the key."""

from __future__ import annotations

import logging

import pytest

from shardwise.engine.nvme import aio_config
from shardwise.errors import UserError


def test_thread_count_and_intra_op_parallelism_both_set_the_threads(caplog) -> None:
    assert aio_config({"thread_count": 3}).intra_op_parallelism == 3  # DeepSpeed 0.19.8 ignores it
    assert aio_config({"intra_op_parallelism": 5}).intra_op_parallelism == 5
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        assert aio_config({"thread_count": 2, "intra_op_parallelism": 6}).intra_op_parallelism == 6
    assert "the newer intra_op_parallelism is used" in caplog.text
    cfg = aio_config({"block_size": 262144, "queue_depth": 4, "single_submit": True, "overlap_events": False})
    assert (cfg.block_size, cfg.queue_depth, cfg.single_submit, cfg.call_bytes) == (262144, 4, True, 262144)


@pytest.mark.parametrize(("section", "message"), [
    ({"use_gds": True}, "aio.use_gds: GPUDirect Storage is not implemented"),
    ({"queue_dept": 8}, "aio.queue_dept: not an aio key"),
    ({"block_size": 1000}, "aio.block_size: a multiple of 4096"),
    ({"intra_op_parallelism": 0}, "aio.intra_op_parallelism: a positive integer"),
])
def test_bad_aio_values_are_refused_naming_the_key(section, message) -> None:
    with pytest.raises(UserError, match=message):
        aio_config(section)


def test_initialize_refuses_bad_nvme_settings_before_training(pool1, tmp_path) -> None:
    out = pool1.run("nvme_cases:refusals", str(tmp_path))[0]
    key = "zero_optimization.offload_optimizer.nvme_path"
    assert out["missing"].startswith(f"UserError: {key}: {tmp_path}/nope does not exist"), out
    assert out["no_path"].startswith(f"UserError: {key}: required with"), out
    assert "aio.use_gds" in out["gds"] and "aio.queue_dept" in out["aio_typo"], out
    assert "NVMe offload steps one group at a time" in out["adafactor"], out
    assert out["left"] == [], out  # a refused run leaves no swap file or lock behind


def test_aio_under_zero_optimization_is_refused_saying_where_it_goes() -> None:
    """HF transformers' docs print the aio section inside zero_optimization; DeepSpeed refuses it there too."""
    from shardwise.config import ConfigError, load_config

    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 2, "aio": {"block_size": 262144, "thread_count": 1}}}
    with pytest.raises(ConfigError, match="zero_optimization.aio: unknown key; 'aio' is a top-level section"):
        load_config(cfg)
