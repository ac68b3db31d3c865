"""What a run leaves for people to look at: metrics.jsonl, TensorBoard events, loss.png, tables.

Only global rank 0 writes. ``metrics.jsonl`` has one JSON object per line: ``"kind": "train"``
lines carry ``step`` and ``loss`` (plus lr, grad norm, tokens, tokens/s, data and step seconds,
memory per kind, bytes moved per collective kind), ``"kind": "eval"`` lines carry ``step``,
``eval_loss`` and ``eval_ppl``. A resumed run first drops the lines after its checkpoint's step, so
the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from shardwise.errors import UserError
from shardwise.files.safe import MANIFEST, OutputFolder, read_in, write_atomic

MEMORY_KEYS = ["params", "grads", "master_params", "optimizer_states", "buffers", "comm_buffers", "total"]


class MetricsLog:
    """Appends metrics lines (and TensorBoard scalars when tensorboard is installed)."""

    def __init__(self, run_dir: Path, resume_step: int):
        """``resume_step``: the step this launch starts at (0: a fresh run, the old file is dropped)."""
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists() or self.path.is_symlink():
            keep = [json.dumps(r) for r in read_metrics(run_dir) if r["step"] <= resume_step]
            write_atomic(self.path, "".join(ln + "\n" for ln in keep).encode())
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step or None)
        except ImportError:  # tensorboard is optional
            pass

    def write(self, row: dict[str, Any]) -> None:
        """One line; a NaN/inf value is written as ``NaN`` / ``Infinity`` / ``-Infinity``, as Python's
        json writes them and its reader (``json.loads``, pandas' ``read_json``) and JavaScript-style
        JSON5 readers take them back as floats: a diverged value stays recognisable, unlike ``null``."""
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, int | float) and k not in ("step", "kind"):
                    self.tb.add_scalar(f"{row['kind']}/{k}", v, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``. A last line cut short (no newline: a crash while it was
    written, the normal state of a killed run) is dropped; a damaged line before it is refused."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists() and not path.is_symlink():
        return []
    text = read_in(run_dir, "metrics.jsonl", path).decode("utf-8", errors="replace")
    lines = text.split("\n")
    rows = []
    for lineno, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or "kind" not in row:
            if lineno == len(lines):  # the partial last line of a crashed run
                break
            raise UserError(f"{path}:{lineno}: not a metrics line (a JSON object with 'kind' and 'step'); "
                            "fix or delete the line")
        rows.append(row)
    return rows


RUN_NAMES = ("run_config.json", "metrics.jsonl", "checkpoints", "data", "hf", "loss.png", "sample.txt",
             "tensorboard", "tokenizer", MANIFEST)  # "tokenizer": checkpoint.run_files.RUN_TOKENIZER


def check_run_folder(run_dir: Path, data: str, overwrite: bool) -> None:
    """Refuse, before any work, a --out that is a file, lies inside --data (or holds it: the run
    would tokenize its own files, or cache tokens among the user's), or holds other files than a
    run's unless ``overwrite`` (which leaves them alone: a run only writes its own names)."""
    data_path = Path(data).resolve()
    if data_path.exists() and data_path.is_relative_to(run_dir.resolve()):
        raise UserError(f"--data {data} lies inside --out {run_dir}; keep the data outside the run folder")
    OutputFolder(run_dir, "--out", inputs=[data], overwrite=True)  # a file, or inside --data: refused
    if run_dir.is_dir() and not overwrite:
        other = sorted(n for n in os.listdir(run_dir) if n not in RUN_NAMES and not n.startswith("."))
        if other:
            raise UserError(f"--out {run_dir}: the folder holds files that are not a shardwise run's "
                            f"({', '.join(other[:3])}{', ...' if len(other) > 3 else ''}); choose a new folder, "
                            "or pass --overwrite (those files are left alone)")


def plot_loss(run_dir: Path) -> Path | None:
    """``loss.png``: train and eval loss against tokens seen (None when nothing was logged)."""
    rows = read_metrics(run_dir)
    train = [r for r in rows if r["kind"] == "train" and isinstance(r.get("loss"), int | float)]
    evals = [r for r in rows if r["kind"] == "eval"]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], lw=1, label="train")
    if evals:
        ax.plot([r["tokens"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval (held out)")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{Path(run_dir).name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(run_dir) / "loss.png"
    fig.savefig(out)
    plt.close(fig)
    return out


def perplexity(loss: float) -> float:
    """exp(loss); inf past float range, NaN for a NaN loss."""
    if math.isnan(loss):
        return loss
    return math.exp(loss) if loss < 700 else float("inf")


def memory_table(rows: list[dict[str, int]]) -> str:
    """Per-rank model-state bytes from ``engine.memory_report()``, in MiB."""
    head = f"{'rank':>4} " + " ".join(f"{k:>16}" for k in MEMORY_KEYS)
    lines = [head, "-" * len(head)]
    for r, rep in enumerate(rows):
        lines.append(f"{r:>4} " + " ".join(f"{rep[k] / 2**20:>12.2f} MiB" for k in MEMORY_KEYS))
    return "\n".join(lines)


def resolved(args: Any) -> dict[str, Any]:
    """What run_config.json records: every option, with the DeepSpeed config inline."""
    out = {k: v for k, v in vars(args).items() if k not in ("run_config", "ds_config", "config")}
    out["config"] = args.ds_config
    return out
