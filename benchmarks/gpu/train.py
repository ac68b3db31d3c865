"""``train``, a section of ``benchmarks/gpu_check.py``: the main job, ``shardwise train --run-config
examples/sonnets.toml``, at world 1 on the GPU (the run config's 80 steps, its evals, checkpoint,
export and sample), as its own process, exactly as a user types it (with ``--out`` in the check's
workdir). What it reports comes from the run's ``metrics.jsonl``: the first and last training loss,
the last eval loss, whether the loss fell, and tokens/s (the median over the steps after the
first, which pays for the allocator and the kernels' first launch). ``--smoke``: 6 steps of 16
tokens per sequence on CPU, no export and no sample, the same command otherwise.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys

from gpu.common import cuda, skip

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def train(smoke: bool, workdir: str, limit_s: float) -> dict:
    if not cuda() and not smoke:
        return skip("no CUDA device")
    run_dir = os.path.join(workdir, "train_sonnets")
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: never an earlier run's metrics or a resume
    cmd = [sys.executable, "-m", "shardwise.cli", "train", "--run-config", "examples/sonnets.toml", "--out", run_dir]
    if smoke:
        cmd += ["--steps", "6", "--seq", "16", "--eval-every", "0", "--sample-tokens", "0", "--no-export"]
    # a job of its own, as typed in a shell: not the rendezvous of this process (--smoke runs the sections in
    # one process, whose MASTER_PORT is taken), a free port chosen by the job
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=max(limit_s - 5, 1))
    except subprocess.TimeoutExpired:
        return {"status": "partial", "rows": [{"error": f"timed out after {limit_s - 5:.0f} s"}]}
    command = " ".join(["shardwise", *cmd[3:]])
    if proc.returncode != 0:
        return {"status": "partial", "rows": [{"command": command, "error": f"exit {proc.returncode}: "
                                               f"{proc.stderr.strip()[-600:]}"}]}
    rows = _metrics(run_dir)
    steps = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    first, last = steps[0]["loss"], steps[-1]["loss"]
    world = next((line.split(": ", 1)[1] for line in proc.stdout.splitlines() if "world 1" in line), "")
    row = {"command": command, "steps": len(steps), "first_loss": first, "last_loss": last,
           "eval_loss": evals[-1]["eval_loss"] if evals else None, "loss_falls": math.isfinite(last) and last < first,
           "tokens_per_step": steps[0]["tokens"], "tokens_per_s": statistics.median(r["tokens_per_s"] for r in
                                                                                    steps[1:] or steps),
           "run": world[-160:]}
    return {"status": "ok" if row["loss_falls"] else "partial", "rows": [row],
            "notes": ["tokens_per_s: median over the steps after the first (metrics.jsonl); loss_falls: the last "
                      "step's training loss below the first's"]}
