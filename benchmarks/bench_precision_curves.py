"""Loss curves of DeepSpeed's low-precision master modes against fp32 masters, on a real training run.

Every run is the sonnets job (``examples/sonnets.toml``: llama-tiny, seq 128, global batch 16, AdamW
lr 3e-3 with warmup and decay, clipping 1.0, ZeRO-2) on 2 ranks, in bf16 compute, differing only in
the master mode (docs/precision.md):

* ``fp32``: fp32 masters and moments (the default), at two seeds (model init and data order): their
  gap is the run-to-run spread a mode's final loss is judged against;
* ``bf16-nearest``: bf16 master and bf16 moments, updates rounded to nearest (a plain bf16 AdamW);
* ``bf16-kahan``: the same with the Kahan compensation (``shardwise.master_update: kahan``);
* ``bf16-stochastic``: the same with stochastic rounding;
* ``bf16-master``: bf16 master with fp32 moments, Kahan.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_precision_curves.py --steps 80 --out runs/precision
    PYTHONPATH=. .venv/bin/python benchmarks/bench_precision_curves.py --steps 80 --lr 3e-4 \
        --modes fp32,bf16-nearest,bf16-kahan,bf16-stochastic --out runs/precision-lr3e-4 \
        --json benchmarks/results/precision_curves_lr3e-4.json --plot docs/precision_loss_lr3e-4.png

writes ``benchmarks/results/precision_curves.json`` (every run's train and eval losses, the final
gaps) and ``docs/precision_loss.png``. Each run is ``shardwise launch --nproc 2 -- train ...`` with the
command line recorded in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = {  # examples/sonnets.toml's [config], in bf16
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "steps_per_print": 0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                       "warmup_num_steps": 10, "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True},
    "bf16": {"enabled": True},
}
MODES = {  # name -> (bf16 keys, shardwise.master_update)
    "fp32": ({}, None),
    "bf16-nearest": ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, "nearest"),
    "bf16-kahan": ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, "kahan"),
    "bf16-stochastic": ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, "stochastic"),
    "bf16-master": ({"bf16_master_weights_and_grads": True}, "kahan"),
}


def ds_config(mode: str, lr: float) -> dict:
    keys, update = MODES[mode]
    cfg = json.loads(json.dumps(BASE))
    cfg["optimizer"]["params"]["lr"] = cfg["scheduler"]["params"]["warmup_max_lr"] = lr
    cfg["bf16"].update(keys)
    if update is not None:
        cfg["shardwise"] = {"master_update": update}
    return cfg


def run(mode: str, seed: int, steps: int, out: Path, model: str, lr: float) -> dict:
    """One training run; returns its command, wall time and curves (from its metrics.jsonl)."""
    folder = out / f"{mode}-s{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    cfg_path = folder.parent / f"{mode}.json"
    cfg_path.write_text(json.dumps(ds_config(mode, lr), indent=1))
    cmd = [sys.executable, "-m", "shardwise.cli", "launch", "--nproc", "2", "--", "train", "--run-config",
           "examples/sonnets.toml", "--config", str(cfg_path), "--model", model, "--out", str(folder),
           "--steps", str(steps), "--seed", str(seed), "--sample-tokens", "0", "--no-export", "--save-every", "0",
           "--overwrite", "--resume", "none"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [(m["step"], m["loss"]) for m in lines if m["kind"] == "train"]
    evals = [(m["step"], m["eval_loss"]) for m in lines if m["kind"] == "eval"]
    mem = next((m["memory"] for m in reversed(lines) if m["kind"] == "train" and m.get("memory")), None)
    return {"mode": mode, "seed": seed, "cmd": " ".join(cmd[1:]), "wall_s": round(wall, 1), "train": train,
            "eval": evals, "final_eval": evals[-1][1], "memory": mem}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        label = f"{r['mode']} (seed {r['seed']})"
        style = "--" if r["mode"] == "fp32" and r["seed"] else "-"
        a.plot(*zip(*r["train"], strict=True), style, label=label, lw=1)
        b.plot(*zip(*r["eval"], strict=True), style + "o", label=label, ms=3, lw=1)
    a.set(xlabel="step", ylabel="train loss", title="train loss (global batch mean)")
    b.set(xlabel="step", ylabel="eval loss", title="held-out loss")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--out", default="runs/precision")
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (sonnets.toml: 3e-3)")
    p.add_argument("--json", default="benchmarks/results/precision_curves.json")
    p.add_argument("--plot", default="docs/precision_loss.png")
    args = p.parse_args(argv)
    out = ROOT / args.out
    runs = [run("fp32", s, args.steps, out, args.model, args.lr) for s in (0, 1)]
    runs += [run(m, 0, args.steps, out, args.model, args.lr) for m in args.modes.split(",") if m != "fp32"]
    ref, spread = runs[0]["final_eval"], abs(runs[0]["final_eval"] - runs[1]["final_eval"])
    gaps = {f"{r['mode']}-s{r['seed']}": r["final_eval"] - ref for r in runs}
    within = {k: abs(v) <= spread for k, v in gaps.items()}
    res = {"steps": args.steps, "model": args.model, "lr": args.lr, "fp32_spread": spread,
           "final_eval_gap_vs_fp32_s0": gaps, "within_spread": within, "runs": runs}
    (ROOT / args.json).write_text(json.dumps(res, indent=1))
    plot(runs, ROOT / args.plot)
    for r in runs:
        key = f"{r['mode']}-s{r['seed']}"
        print(f"{key:>18}: final eval {r['final_eval']:.4f}  gap {gaps[key]:+.4f}  ({r['wall_s']} s)")
    print(f"fp32 run-to-run spread (seeds 0, 1): {spread:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
