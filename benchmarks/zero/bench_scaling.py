"""Scaling table: step time, ratios, model-state bytes and bytes moved, over model size and ranks.

    python benchmarks/zero/bench_scaling.py                                   # 21M/90M/300M x 2/4 ranks, all modes
    python benchmarks/zero/bench_scaling.py --sizes 21m --nprocs 2 --modes ddp,sw3,fsdp2 --repeats 5   # steadiness

For every (size, ranks) cell it runs ``bench_zero.py`` once with ``--repeats`` rounds: inside a
cell the modes run round-robin (ddp, sw1, ..., then again), so load from other jobs spreads over
every mode alike; each mode's figure is the median of its rounds' medians, and ``spread`` is
(slowest round / fastest round - 1). Writes ``benchmarks/results/scaling.json``,
``docs/results/benchmarks_scaling.md`` (the date, CPU model, command, the table, per-round figures) and
``docs/figures/scaling_ratio.png`` (step-time ratio to DDP against parameters, one line per mode and ranks;
needs matplotlib). With more ranks than cores a rank waits for a core, so the times of those cells
say little: the table marks them and their bytes (model states, bytes moved) are what to read.

Model-state bytes per rank are measured (live tensor storages, see bench_zero.py) and shown next to
the ZeRO formula for fp32 AdamW (params + grads + 2 moments, Ψ parameters over N ranks): DDP and
stage 0 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, stage 3 (and FSDP2) 16Ψ/N; bf16 with fp32
masters and moments (2 + 2 + 4 + 8 bytes per parameter, the ZeRO paper's mixed precision): stage 1
4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SIZES: dict[str, str | dict] = {
    "21m": "llama-20m",
    "90m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
            "num_key_value_heads": 4},
    "300m": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24, "num_attention_heads": 16,
             "num_key_value_heads": 8},
}
DEFAULT_MODES = "ddp,sw1,sw2,sw3,fsdp2,ds2,ds3,sw3-bf16,fsdp2-bf16,ds3-bf16"
STAGE = {"ddp": 0, "sw0": 0, "sw1": 1, "ds1": 1, "sw2": 2, "ds2": 2}


def formula_bytes(mode: str, params: int, nproc: int) -> float:
    """ZeRO model-state bytes per rank for AdamW (see the module doc): fp32, or bf16 with fp32 masters."""
    stage = STAGE.get(mode.removesuffix("-bf16"), 3)
    if mode.endswith("-bf16"):  # the ZeRO paper's mixed precision: 2 + 2 bytes replicated, K = 12 sharded
        return {0: 16 * params, 1: 4 * params + 12 * params / nproc, 2: 2 * params + 14 * params / nproc}.get(
            stage, 16 * params / nproc)
    return {0: 16 * params, 1: 8 * params + 8 * params / nproc, 2: 4 * params + 12 * params / nproc}.get(
        stage, 16 * params / nproc)


def model_spec(size: str, work: Path) -> str:
    spec = SIZES[size]
    if isinstance(spec, str):
        return spec
    path = work / f"config_{size}.json"
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
                                "max_position_embeddings": 2048, "tie_word_embeddings": False, **spec}))
    return str(path)


def run_cell(size: str, nproc: int, args: argparse.Namespace, work: Path) -> dict:
    out = work / f"{size}_{nproc}.json"
    cmd = [sys.executable, str(HERE / "bench_zero.py"), "--no-doc", "--nproc", str(nproc), "--modes", args.modes,
           "--repeats", str(args.repeats), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--model", model_spec(size, work), "--results-json", str(out)]
    if args.offload_optimizer:
        cmd.append("--offload-optimizer")
    print(f"[scaling] {size} x {nproc} ranks: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, text=True, cwd=REPO)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"bench_zero.py exited {proc.returncode}"}
    return json.loads(out.read_text())


def rows_of(size: str, nproc: int, cell: dict) -> list[dict]:
    if "error" in cell:
        return [{"size": size, "nproc": nproc, "mode": "-", "error": cell["error"]}]
    results, runs = cell["results"], cell["runs"]
    ddp = results.get("ddp", {}).get("step_ms_median")
    oversubscribed = nproc > (os.cpu_count() or 1)
    out = []
    for mode, r in results.items():
        if "error" in r:
            out.append({"size": size, "nproc": nproc, "mode": mode, "error": r["error"]})
            continue
        rounds = [x["step_ms_median"] for x in runs[mode] if "error" not in x]
        states = max(r["model_state_bytes"])
        comm = r.get("comm_stats") or {}  # shardwise modes only: bytes per kind since start
        per_step = cell["meta"]["steps"] + cell["meta"]["warmup"] + 1  # bench_zero_worker's extra untimed step
        moved = sum(v for k, v in comm.items() if k != "broadcast") / per_step if comm else None
        out.append({"size": size, "params": r["params"], "nproc": nproc, "mode": mode,
                    "step_ms": r["step_ms_median"], "rounds_ms": [round(x, 1) for x in rounds],
                    "fwd_bwd_opt_ms": [round(r[k], 1) for k in ("fwd_ms", "bwd_ms", "opt_ms")],
                    "spread": max(rounds) / min(rounds) - 1 if rounds else None,
                    "x_ddp": ddp / r["step_ms_median"] if ddp else None,
                    "states_MiB": states / 2**20, "formula_MiB": formula_bytes(mode, r["params"], nproc) / 2**20,
                    "MiB_moved_per_step": moved / 2**20 if moved is not None else None,
                    "time_meaningful": not oversubscribed})
    return out


PEERS = {"fp32": ("fsdp2", "ds3"), "bf16": ("fsdp2-bf16", "ds3-bf16")}


def best_peer_ratio(row: dict, rows: list[dict]) -> float | None:
    """Stage-3 modes: the faster of FSDP2 and DeepSpeed ZeRO-3 (same cell, same precision) / this time."""
    if row["mode"] not in ("sw3", "sw3-bf16") or not row.get("step_ms"):
        return None
    peers = PEERS["bf16" if row["mode"].endswith("bf16") else "fp32"]
    times = [r["step_ms"] for r in rows if r.get("step_ms") and r["mode"] in peers
             and (r["size"], r["nproc"]) == (row["size"], row["nproc"])]
    return min(times) / row["step_ms"] if times else None


def _cell(col: str, v: object) -> str:
    if v is None or v == "":
        return "–"
    if col == "spread":
        return f"{v:.0%}"
    if col in ("step_ms",):
        return f"{v:.0f}"
    if col == "rounds_ms":
        return ", ".join(f"{x:.0f}" for x in v)
    if col == "params":
        return f"{v / 1e6:.1f}M"
    if isinstance(v, float):
        return f"{v:.2f}" if col.startswith("x_") else f"{v:.1f}"
    return str(v)


def markdown(rows: list[dict], meta: dict) -> str:
    cols = ["size", "params", "nproc", "mode", "step_ms", "x_ddp", "x_best_peer", "spread", "rounds_ms", "states_MiB",
            "formula_MiB", "MiB_moved_per_step", "time_meaningful"]
    lines = [f"# Scaling table ({meta['date']})", "", f"Machine: {meta['cpu']} ({meta['cores']} cores). "
             f"Command: `{meta['command']}`. {meta['repeats']} round-robin rounds per cell; step_ms is the median "
             "of the rounds' medians, spread = slowest / fastest round - 1, x_ddp = DDP's time / this mode's "
             "(above 1: faster), x_best_peer (stage 3) = the faster of FSDP2 and DeepSpeed ZeRO-3 / this mode's. "
             "MiB_moved_per_step: shardwise's own count of the bytes it sent per step (`comm_stats`; the peers do "
             "not count theirs). time_meaningful is false where ranks outnumber cores: read the bytes there.",
             "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        r = {**r, "x_best_peer": best_peer_ratio(r, rows)}
        if len(r.get("rounds_ms") or []) < 2:  # one round: no spread to speak of
            r["spread"] = None
        cells = [_cell(c, r.get(c, r.get("error", "") if c == "mode" else "")) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> str:
    """Ratio to DDP against parameters, one line per (mode, ranks); a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib, then --from-json)"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in rows:
        if r.get("x_ddp") and r["mode"] != "ddp" and r.get("time_meaningful", True):  # ranks > cores: no time
            lines.setdefault((r["mode"], r["nproc"]), []).append((r["params"], r["x_ddp"]))
    colors = plt.get_cmap("tab20").colors  # one color a line; shardwise solid, peers dashed; bf16 squares
    for i, ((mode, nproc), pts) in enumerate(sorted(lines.items())):
        pts.sort()
        ax.plot([p for p, _ in pts], [x for _, x in pts], color=colors[i % len(colors)],
                ls="-" if mode.startswith("sw") else "--", marker="s" if mode.endswith("bf16") else "o",
                label=f"{mode}, {nproc} ranks")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("speed relative to DDP (DDP time / mode time)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}"


def merged_meta(metas: list[dict]) -> dict:
    """One header for cells measured by several commands: every date, command and round count."""
    if len(metas) == 1:
        return metas[0]
    return {"date": ", ".join(dict.fromkeys(m["date"] for m in metas)), "cpu": metas[0]["cpu"],
            "cores": metas[0]["cores"], "repeats": "/".join(str(m["repeats"]) for m in metas),
            "command": "`; `".join(m["command"] for m in metas)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="21m,90m,300m", help=f"comma list of {', '.join(SIZES)}")
    p.add_argument("--nprocs", default="2,4")
    p.add_argument("--modes", default=DEFAULT_MODES, help="bench_zero.py modes")
    p.add_argument("--repeats", type=int, default=3, help="round-robin rounds per cell")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--offload-optimizer", action="store_true", help="passed to bench_zero.py")
    p.add_argument("--from-json", type=Path, nargs="+", help="re-render the doc and plot from saved results "
                   "(several: their rows in one table, e.g. cells measured in separate commands)")
    p.add_argument("--name", default="scaling",
                   help="stem of the outputs (results/NAME.json, docs/results/benchmarks_NAME.md)")
    args = p.parse_args(argv)
    if args.from_json:
        saved = [json.loads(f.read_text()) for f in args.from_json]
        rows, meta = [r for s in saved for r in s["rows"]], merged_meta([s["meta"] for s in saved])
    else:
        work = REPO / ".cache" / "bench_scaling"
        work.mkdir(parents=True, exist_ok=True)
        rows = []
        for size in args.sizes.split(","):
            for nproc in (int(n) for n in args.nprocs.split(",")):
                rows += rows_of(size, nproc, run_cell(size, nproc, args, work))
        sys.path.insert(0, str(HERE.parent))  # benchmarks/: the shared helpers in shared/
        from shared.machine import RESULTS, cpu_model

        meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(),
                "cores": os.cpu_count(), "repeats": args.repeats,
                "command": " ".join(["python", "benchmarks/zero/bench_scaling.py", *(argv or sys.argv[1:])])}
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    doc = REPO / "docs" / "results" / f"benchmarks_{args.name}.md"
    note = plot(rows, REPO / "docs" / "figures" / f"{args.name}_ratio.png")
    doc.write_text(markdown(rows, meta) + f"\n{note}\n")
    medians = [r["spread"] for r in rows if r.get("spread") is not None]
    print(f"wrote {doc.relative_to(REPO)}; {note}; largest spread {max(medians, default=float('nan')):.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
