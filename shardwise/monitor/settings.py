"""The monitoring and profiling sections of a DeepSpeed config, as pydantic models.

Keys and defaults are DeepSpeed 0.19's (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``,
``comms_logger``, ``flops_profiler``), so a config written for DeepSpeed loads unchanged and a typo
inside a section is an error naming the key instead of a log that silently never appears. The
models live here, next to the code that honours them; ``shardwise.config``'s schema holds them as
fields. Nothing here imports the rest of shardwise (the config package imports this module).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _strict_bool(value: Any) -> Any:
    """true/false or 1/0, never a string ("false" must not read as on), as the rest of the schema."""
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise ValueError(f"expected true or false (a JSON boolean, or 1/0), got {type(value).__name__} {value!r}")


Flag = Annotated[bool, BeforeValidator(_strict_bool)]


class MonitorSection(BaseModel):
    """A checked section (unknown keys are errors), readable as the JSON dict it came from."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default) if key in type(self).model_fields else default

    def __getitem__(self, key: str) -> Any:
        if key not in type(self).model_fields:
            raise KeyError(key)
        return getattr(self, key)


class TensorBoardConfig(MonitorSection):
    """Event files in ``output_path/job_name/`` (``output_path`` "" is the working directory)."""

    enabled: Flag = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CSVConfig(MonitorSection):
    """One CSV file per tag in ``output_path/job_name/``, named after the tag (``/`` -> ``_``)."""

    enabled: Flag = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(MonitorSection):
    """A W&B run (``WANDB_MODE=offline`` keeps it on disk for ``wandb sync``)."""

    enabled: Flag = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CometConfig(MonitorSection):
    """A Comet experiment (the ``comet_ml`` package, extra ``shardwise[monitor]``)."""

    enabled: Flag = False
    samples_log_interval: int = Field(100, gt=0)
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: Flag | None = None
    mode: str | None = None


class CommsLoggerConfig(MonitorSection):
    """Per-collective counts, sizes, latencies and bandwidths (``deepspeed.comm.log_summary()``)."""

    enabled: Flag = False
    prof_all: Flag = True
    prof_ops: list[str] = Field(default_factory=list)
    verbose: Flag = False
    debug: Flag = False


class FlopsProfilerConfig(MonitorSection):
    """The model profile at global step ``profile_step`` (DeepSpeed's keys and defaults)."""

    enabled: Flag = False
    recompute_fwd_factor: float = Field(0.0, ge=0)
    profile_step: int = Field(1, ge=0)
    module_depth: int = Field(-1, ge=-1)
    top_modules: int = Field(1, ge=1)
    detailed: Flag = True
    output_file: str | None = None


def monitors_on(config: Any) -> list[str]:
    """The monitor sections ``config`` enables, in DeepSpeed's order."""
    return [name for name in ("tensorboard", "wandb", "csv_monitor", "comet") if getattr(config, name).enabled]
