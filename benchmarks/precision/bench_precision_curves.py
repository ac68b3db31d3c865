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

    PYTHONPATH=. .venv/bin/python benchmarks/precision/bench_precision_curves.py --steps 80 --out runs/precision
    PYTHONPATH=. .venv/bin/python benchmarks/precision/bench_precision_curves.py --steps 80 --lr 3e-4 \
        --modes fp32,bf16-nearest,bf16-kahan,bf16-stochastic --out runs/precision-lr3e-4 \
        --json benchmarks/results/precision_curves_lr3e-4.json --plot docs/figures/precision_loss_lr3e-4.png
    PYTHONPATH=. .venv/bin/python benchmarks/precision/bench_precision_curves.py \
        --model benchmarks/models/llama-0.1b.json \
        --steps 200 --seq 64 --batch 2 --micro-batch 1 --lr 3e-4 --eval-every 25 \
        --modes fp32,bf16-kahan,bf16-stochastic,bf16-nearest --out runs/precision-0.1b \
        --json benchmarks/results/precision_curves_0.1b.json --plot docs/figures/precision_loss_0.1b.png
    PYTHONPATH=. .venv/bin/python benchmarks/precision/bench_precision_curves.py --replot --smooth 10 \
        --json benchmarks/results/precision_curves_0.1b.json --plot docs/figures/precision_loss_0.1b.png

(the third: a 101M-parameter Llama from ``benchmarks/models/llama-0.1b.json``, byte vocabulary, global
batch 2 of 64 tokens, sized for a shared 2-core CPU).

writes ``benchmarks/results/precision_curves.json`` (every run's train and eval losses, the final
gaps) and ``docs/figures/precision_loss.png``. Each run is ``shardwise launch --nproc 2 -- train ...`` with the
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

ROOT = Path(__file__).resolve().parents[2]
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


def ds_config(mode: str, args: argparse.Namespace) -> dict:
    keys, update = MODES[mode]
    cfg = json.loads(json.dumps(BASE))
    cfg["optimizer"]["params"]["lr"] = cfg["scheduler"]["params"]["warmup_max_lr"] = args.lr
    cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"] = args.batch, args.micro_batch
    cfg["bf16"].update(keys)
    if update is not None:
        cfg["shardwise"] = {"master_update": update}
    return cfg


def run(mode: str, seed: int, out: Path, args: argparse.Namespace) -> dict:
    """One training run; returns its command, wall time and curves (from its metrics.jsonl)."""
    folder = out / f"{mode}-s{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    cfg_path = folder.parent / f"{mode}.json"
    cfg_path.write_text(json.dumps(ds_config(mode, args), indent=1))
    cmd = [sys.executable, "-m", "shardwise.cli", "launch", "--nproc", "2", "--", "train", "--run-config",
           "examples/sonnets.toml", "--config", str(cfg_path), "--model", args.model, "--out", str(folder),
           "--steps", str(args.steps), "--seed", str(seed), "--seq", str(args.seq), "--eval-every",
           str(args.eval_every), "--sample-tokens", "0", "--no-export", "--save-every", "0", "--overwrite",
           "--resume", "none"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [(m["step"], m["loss"]) for m in lines if m["kind"] == "train"]
    evals = [(m["step"], m["eval_loss"]) for m in lines if m["kind"] == "eval"]
    mem = next((m["memory"] for m in reversed(lines) if m["kind"] == "train" and m.get("memory")), None)
    tail = [loss for _, loss in train[-args.tail:]]
    return {"mode": mode, "seed": seed, "cmd": " ".join(cmd[1:]), "wall_s": round(wall, 1), "train": train,
            "eval": evals, "final_eval": evals[-1][1], "final_train": sum(tail) / len(tail), "memory": mem}


def summary(runs: list[dict], args: argparse.Namespace) -> dict:
    """Each run's final held-out and train-tail loss against fp32 masters at seed 0, and the fp32 spread."""
    res: dict = {"steps": args.steps, "model": args.model, "lr": args.lr, "seq": args.seq, "batch": args.batch,
                 "train_tail_steps": args.tail}
    for key in ("final_eval", "final_train"):
        if len(runs) < 2:
            break
        ref = runs[0][key]
        gaps = {f"{r['mode']}-s{r['seed']}": r[key] - ref for r in runs}
        spread = abs(gaps["fp32-s1"])
        res[key] = {"fp32_spread": spread, "gap_vs_fp32_s0": gaps,
                    "within_spread": {k: abs(v) <= spread for k, v in gaps.items()}}
    if "final_eval" in res:  # the names the earlier result files use
        res["fp32_spread"] = res["final_eval"]["fp32_spread"]
        res["final_eval_gap_vs_fp32_s0"] = res["final_eval"]["gap_vs_fp32_s0"]
        res["within_spread"] = res["final_eval"]["within_spread"]
    res["runs"] = runs
    return res


def _trailing_mean(values: list[float], n: int) -> list[float]:
    return [sum(values[max(0, i + 1 - n):i + 1]) / len(values[max(0, i + 1 - n):i + 1]) for i in range(len(values))]


def plot(runs: list[dict], path: Path, smooth: int = 1) -> None:
    """Train loss (a trailing mean over ``smooth`` steps: one step of a small batch is noisy), its difference
    to the first run's (fp32 masters, seed 0: the same batches), and the eval loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, d, b) = plt.subplots(1, 3, figsize=(15, 4))
    ref = _trailing_mean([loss for _, loss in runs[0]["train"]], smooth)
    for r in runs:
        label = f"{r['mode']} (seed {r['seed']})"
        style = "--" if r["mode"] == "fp32" and r["seed"] else "-"
        steps, losses = zip(*r["train"], strict=True)
        mean = _trailing_mean(list(losses), smooth)
        a.plot(steps, mean, style, label=label, lw=1)
        d.plot(steps, [x - y for x, y in zip(mean, ref, strict=True)], style, label=label, lw=1)
        b.plot(*zip(*r["eval"], strict=True), style + "o", label=label, ms=3, lw=1)
    title = "train loss" + (f" (mean of the last {smooth} steps)" if smooth > 1 else " (global batch mean)")
    a.set(xlabel="step", ylabel="train loss", title=title)
    d.set(xlabel="step", ylabel="difference", title="train loss minus fp32 masters' (seed 0), same mean")
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
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (sonnets.toml: 128)")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences (sonnets.toml: 16)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per micro-step (sonnets: 4)")
    p.add_argument("--eval-every", type=int, default=10, help="steps between held-out evals (sonnets: 10)")
    p.add_argument("--tail", type=int, default=10, help="final train loss: the mean of this many last steps")
    p.add_argument("--json", default="benchmarks/results/precision_curves.json")
    p.add_argument("--plot", default="docs/figures/precision_loss.png")
    p.add_argument("--smooth", type=int, default=1, help="the plot's train loss: a trailing mean over N steps")
    p.add_argument("--replot", action="store_true", help="no runs: the plot again from --json's curves")
    args = p.parse_args(argv)
    if args.replot:
        plot(json.loads((ROOT / args.json).read_text())["runs"], ROOT / args.plot, args.smooth)
        return 0
    out = ROOT / args.out
    plan = [("fp32", 0), ("fp32", 1)] + [(m, 0) for m in args.modes.split(",") if m != "fp32"]
    runs: list[dict] = []
    for mode, seed in plan:  # the JSON and plot after every run: a long series shows its progress
        runs.append(run(mode, seed, out, args))
        res = summary(runs, args)
        (ROOT / args.json).write_text(json.dumps(res, indent=1))
        plot(runs, ROOT / args.plot, args.smooth)
        r = runs[-1]
        print(f"{mode}-s{seed}: final eval {r['final_eval']:.4f}, train (last {args.tail}) "
              f"{r['final_train']:.4f} ({r['wall_s']} s)", flush=True)
    for key in ("final_eval", "final_train"):
        print(f"{key}: fp32 spread {res[key]['fp32_spread']:.4f}, gaps "
              + ", ".join(f"{k} {v:+.4f}" for k, v in res[key]["gap_vs_fp32_s0"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
