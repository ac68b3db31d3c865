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
from pathlib import Path
from typing import Any

MEMORY_KEYS = ["params", "grads", "master_params", "optimizer_states", "buffers", "total"]


class MetricsLog:
    """Appends metrics lines (and TensorBoard scalars when tensorboard is installed)."""

    def __init__(self, run_dir: Path, resume_step: int):
        """``resume_step``: the step this launch starts at (0: a fresh run, the old file is dropped)."""
        self.path = run_dir / "metrics.jsonl"
        if self.path.is_file():
            keep = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in keep))
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step or None)
        except ImportError:  # tensorboard is optional
            pass

    def write(self, row: dict[str, Any]) -> None:
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
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []


def plot_loss(run_dir: Path) -> Path | None:
    """``loss.png``: train and eval loss against tokens seen (None when nothing was logged)."""
    rows = read_metrics(run_dir)
    train = [r for r in rows if r["kind"] == "train"]
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
    return math.exp(loss) if loss < 700 else float("inf")


def memory_table(rows: list[dict[str, int]]) -> str:
    """Per-rank model-state bytes from ``engine.memory_report()``, in MiB."""
    head = f"{'rank':>4} " + " ".join(f"{k:>16}" for k in MEMORY_KEYS)
    lines = [head, "-" * len(head)]
    for r, rep in enumerate(rows):
        lines.append(f"{r:>4} " + " ".join(f"{rep[k] / 2**20:>12.2f} MiB" for k in MEMORY_KEYS))
    return "\n".join(lines)
