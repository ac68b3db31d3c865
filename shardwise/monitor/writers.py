"""The monitors: TensorBoard, CSV, Weights & Biases and Comet, written by global rank 0 only.

An event is DeepSpeed's ``(tag, value, global_samples)``; every monitor gets the same events. Each
write is flushed (TensorBoard's writer, the CSV file closed after its row; W&B and Comet hand the
row to their own process at once), so a crash loses at most the step in flight. Layout and names
are DeepSpeed's: ``output_path/job_name/`` holds the event file or one CSV per tag named after the
tag (``Train/Samples/lr`` -> ``Train_Samples_lr.csv`` with the header ``step,lr``).
"""

from __future__ import annotations

import csv
import importlib.util
import os
from typing import Any

from shardwise.errors import OneLineError

Event = tuple[str, float, int]
# section -> (the module it needs, the package to install)
NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
         "comet": ("comet_ml", "comet_ml"), "csv_monitor": (None, None)}


class MissingExtra(ImportError, OneLineError):
    """A monitor is enabled and the package it writes with is not installed."""


def check_installed(config: Any) -> None:
    """Every rank, before any work: an enabled monitor whose package is missing is one line naming both."""
    for section, (module, package) in NEEDS.items():
        if module is not None and getattr(config, section).enabled and importlib.util.find_spec(module) is None:
            raise MissingExtra(f"{section}.enabled: the {package} package is not installed; pip install "
                               f"'shardwise[monitor]' (or pip install {package}), or set {section}.enabled to false")


def log_dir(section: Any) -> str:
    """DeepSpeed's ``output_path/job_name`` ("" output_path: the working directory)."""
    path = os.path.join(section.output_path, section.job_name)
    os.makedirs(path, exist_ok=True)
    return path


class TensorBoardWriter:
    def __init__(self, section: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir(section))

    def write(self, events: list[Event]) -> None:
        for tag, value, step in events:
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CSVWriter:
    def __init__(self, section: Any) -> None:
        self.dir = log_dir(section)
        self.started: set[str] = set()

    def write(self, events: list[Event]) -> None:
        for tag, value, step in events:
            name = tag.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.dir, name + ".csv"), "a", newline="") as f:
                out = csv.writer(f)
                if name not in self.started:  # a new run appends to an old file with its own header
                    self.started.add(name)
                    out.writerow(["step", tag.rsplit("/", 1)[-1]])
                out.writerow([step, value])

    def close(self) -> None:
        pass


class WandbWriter:
    def __init__(self, section: Any) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=section.project, group=section.group, entity=section.team)

    def write(self, events: list[Event]) -> None:
        for tag, value, step in events:
            self.run.log({tag: value}, step=step)

    def close(self) -> None:
        self.run.finish()


class CometWriter:
    """Comet's experiment; rows are sent once ``samples_log_interval`` samples passed since the last."""

    def __init__(self, section: Any) -> None:
        import comet_ml

        self.experiment = comet_ml.start(api_key=section.api_key, project=section.project,
                                         workspace=section.workspace, experiment_key=section.experiment_key,
                                         mode=section.mode, online=section.online)
        if section.experiment_name is not None:
            self.experiment.set_name(section.experiment_name)
        self.interval, self.last = section.samples_log_interval, None

    def write(self, events: list[Event]) -> None:
        for tag, value, step in events:
            if self.last is None or step == self.last or step - self.last >= self.interval:
                self.experiment.log_metric(tag, value, step=step)
                self.last = step

    def close(self) -> None:
        self.experiment.end()


_WRITERS = {"tensorboard": TensorBoardWriter, "wandb": WandbWriter, "csv_monitor": CSVWriter, "comet": CometWriter}


class Monitors:
    """The enabled monitors of a config. ``enabled`` is the config's answer (the same on every rank);
    only the rank given ``write=True`` (global rank 0) opens and writes anything."""

    def __init__(self, config: Any, write: bool) -> None:
        check_installed(config)
        names = [n for n in ("tensorboard", "wandb", "csv_monitor", "comet") if getattr(config, n).enabled]
        self.enabled = bool(names)
        self.writers = [_WRITERS[n](getattr(config, n)) for n in names] if write else []

    def write_events(self, events: list[Event]) -> None:
        for w in self.writers:
            w.write(events)

    def close(self) -> None:
        for w in self.writers:
            w.close()
        self.writers = []
