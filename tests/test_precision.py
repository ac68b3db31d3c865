"""DynamicLossScaler follows DeepSpeed's fp16 loss-scaling rules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardwise.optim.loss_scale import DynamicLossScaler


def test_overflow_halves_only_after_hysteresis() -> None:
    s = DynamicLossScaler(init_scale=2**16, hysteresis=3, scale_window=1000)
    assert s.update(True) is True and s.scale == 2**16  # 3 -> 2
    assert (
        s.overflow_message(1) == "fp16 overflow at step 1: skipped, loss scale 65536 kept (hysteresis 2 left)"
    )
    assert s.update(True) is True and s.scale == 2**16  # 2 -> 1
    assert s.update(True) is True and s.scale == 2**15  # exhausted: halve
    assert s.overflow_message(12) == "fp16 overflow at step 12: skipped, loss scale 65536 -> 32768"
    assert s.update(True) and s.scale == 2**14  # stays exhausted until a reset
    assert s.update(False) is False and s.scale == 2**14


def test_min_scale_floor() -> None:
    s = DynamicLossScaler(init_scale=8, hysteresis=1, min_scale=2)
    s.update(True)
    s.update(True)
    assert s.scale == 2
    assert s.update(True) is True and s.scale == 2
    assert "kept (at min_loss_scale)" in s.overflow_message(3)
    strict = DynamicLossScaler(init_scale=2, hysteresis=1, min_scale=2, raise_error_at_min_scale=True)
    with pytest.raises(RuntimeError, match="min_loss_scale"):
        strict.update(True)


def test_growth_after_window_and_hysteresis_reset() -> None:
    s = DynamicLossScaler(init_scale=4, scale_window=3, hysteresis=2)
    for _ in range(2):
        s.update(False)
    assert s.scale == 4
    s.update(False)  # third good iteration since start
    assert s.scale == 8
    s.update(True)  # hysteresis 2 -> 1, scale kept; window restarts
    assert s.scale == 8 and s.cur_hysteresis == 1
    s.update(False)
    s.update(False)
    assert s.cur_hysteresis == 1  # not consecutive: no reset before the window completes
    s.update(False)
    assert s.scale == 16 and s.cur_hysteresis == 2  # grew and reset the counter
    s.update(True)
    s.update(False)
    s.update(True)  # counter was not reset by the good step in between -> halve
    assert s.scale == 8


def test_consecutive_hysteresis_resets_on_every_good_step() -> None:
    s = DynamicLossScaler(init_scale=16, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    for _ in range(5):
        s.update(True)
        s.update(False)
    assert s.scale == 16  # isolated overflows never exhaust the counter
    s.update(True)
    s.update(True)
    assert s.scale == 8


def test_static_scale() -> None:
    s = DynamicLossScaler.from_fp16_config(SimpleNamespace(loss_scale=128, initial_scale_power=16))
    assert not s.dynamic and s.scale == 128
    assert s.update(True) is True and s.scale == 128
    assert s.overflow_message(4) == "fp16 overflow at step 4: skipped, loss scale 128 (static)"
    for _ in range(5000):
        s.update(False)
    assert s.scale == 128


def test_from_fp16_config_dynamic() -> None:
    cfg = SimpleNamespace(
        loss_scale=0,
        initial_scale_power=12,
        loss_scale_window=50,
        hysteresis=4,
        consecutive_hysteresis=True,
        min_loss_scale=0.5,
    )
    s = DynamicLossScaler.from_fp16_config(cfg)
    assert (s.dynamic, s.scale, s.scale_window, s.hysteresis, s.consecutive_hysteresis, s.min_scale) == (
        True,
        4096.0,
        50,
        4,
        True,
        0.5,
    )
    d = DynamicLossScaler.from_fp16_config({"enabled": True, "loss_scale": 0})
    assert d.scale == 2**16 and d.scale_window == 1000 and d.hysteresis == 2 and d.min_scale == 1.0


def test_state_dict_round_trip() -> None:
    def run(s: DynamicLossScaler, pattern: str) -> list[float]:
        out = []
        for c in pattern:
            s.update(c == "x")
            out.append(s.scale)
        return out

    a = DynamicLossScaler(init_scale=64, scale_window=4, hysteresis=2)
    run(a, "..x.x..")
    b = DynamicLossScaler(init_scale=64, scale_window=4, hysteresis=2)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    rest = "...x.....xx......"
    assert run(b, rest) == run(a, rest)
