"""fp16 loss scaling with DeepSpeed's semantics.

Pure bookkeeping: the engine decides whether a step overflowed (a collective over all ranks) and
passes the verdict to :meth:`DynamicLossScaler.update`, so every rank makes the same decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DynamicLossScaler"]


def _fmt(scale: float) -> str:
    return str(int(scale)) if float(scale).is_integer() else f"{scale:g}"


class DynamicLossScaler:
    """Loss scale that halves on overflow (after ``hysteresis`` overflows) and doubles when stable.

    DeepSpeed semantics, with iterations counted by :meth:`update` calls:
    - overflow: if the hysteresis counter is 1 the scale halves (floored at ``min_scale``), else the
      counter is decremented; the step is skipped either way.
    - no overflow: the scale doubles once ``scale_window`` good iterations have passed since the last
      overflow (or since the start), and then also resets the hysteresis counter; with
      ``consecutive_hysteresis`` the counter resets on every good iteration instead, so only
      back-to-back overflows count toward a halving.
    - static (``dynamic=False``): the scale never changes, an overflow still skips the step.
    ``raise_error_at_min_scale`` mirrors DeepSpeed's fail-fast when an overflow would need to go
    below ``min_scale`` (DeepSpeed enables it by default; off here so the floor just holds).
    """

    def __init__(
        self,
        init_scale: float = 2**16,
        scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        dynamic: bool = True,
        raise_error_at_min_scale: bool = False,
    ) -> None:
        if init_scale <= 0 or min_scale <= 0:
            raise ValueError(f"loss scales must be positive (init_scale={init_scale}, min_scale={min_scale})")
        if scale_window < 1 or hysteresis < 1:
            raise ValueError(f"scale_window and hysteresis must be >= 1 (got {scale_window}, {hysteresis})")
        self.scale = float(init_scale)
        self.scale_window = int(scale_window)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_scale)
        self.dynamic = bool(dynamic)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_hysteresis = self.hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self._prev_scale = self.scale  # scale before the latest update, for overflow_message
        self._event = "none"  # what the latest update did: static|floor|hysteresis|halved|grew|none

    @classmethod
    def from_fp16_config(cls, fp16_cfg: Any) -> DynamicLossScaler:
        """From the ``fp16`` config section (object or mapping); ``loss_scale`` 0 means dynamic."""

        def get(name: str, default: Any) -> Any:
            value = (
                fp16_cfg.get(name, default)
                if isinstance(fp16_cfg, Mapping)
                else getattr(fp16_cfg, name, default)
            )
            return default if value is None else value

        static = float(get("loss_scale", 0.0))
        if static > 0:
            return cls(init_scale=static, dynamic=False)
        return cls(
            init_scale=2.0 ** int(get("initial_scale_power", 16)),
            scale_window=int(get("loss_scale_window", 1000)),
            hysteresis=int(get("hysteresis", 2)),
            consecutive_hysteresis=bool(get("consecutive_hysteresis", False)),
            min_scale=float(get("min_loss_scale", 1.0)),
        )

    def update(self, overflow: bool) -> bool:
        """Record one iteration's overflow verdict; returns True when the step must be skipped."""
        self._prev_scale = self.scale
        self._event = "none"
        if not self.dynamic:
            self._event = "static"
            self.cur_iter += 1
            return bool(overflow)
        if overflow:
            if self.cur_hysteresis <= 1:
                if self.raise_error_at_min_scale and self.scale <= self.min_scale:
                    raise RuntimeError(
                        f"fp16 overflow with the loss scale already at min_loss_scale="
                        f"{_fmt(self.min_scale)}; the run cannot recover (check data/model for inf or nan, "
                        "or use bf16)"
                    )
                self.scale = max(self.scale / 2.0, self.min_scale)
                self._event = "halved" if self.scale < self._prev_scale else "floor"
            else:
                self.cur_hysteresis -= 1
                self._event = "hysteresis"
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= 2.0
                self._event = "grew"
        self.cur_iter += 1
        return bool(overflow)

    def overflow_message(self, step: int) -> str:
        """One log line describing the latest (overflowed) update."""
        head = f"fp16 overflow at step {step}: skipped, loss scale "
        if self._event == "static":
            return head + f"{_fmt(self.scale)} (static)"
        if self._event == "floor":
            return head + f"{_fmt(self.scale)} kept (at min_loss_scale)"
        if self._event == "hysteresis":
            return head + f"{_fmt(self.scale)} kept (hysteresis {self.cur_hysteresis} left)"
        return head + f"{_fmt(self._prev_scale)} -> {_fmt(self.scale)}"

    def state_dict(self) -> dict[str, Any]:
        """Counters and scale; the configuration is rebuilt from the config, not the checkpoint."""
        return {
            "scale": self.scale,
            "cur_hysteresis": self.cur_hysteresis,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore counters; a static scaler keeps its configured scale (as DeepSpeed does)."""
        if self.dynamic:
            self.scale = float(d["scale"])
        self.cur_hysteresis = int(d["cur_hysteresis"])
        self.cur_iter = int(d["cur_iter"])
        self.last_overflow_iter = int(d["last_overflow_iter"])
        self._prev_scale = self.scale
