"""Long context: activation bytes per rank against sequence length, and the longest sequence in a fixed
per-rank budget, with Ulysses SP 1, 2 and 4 and ALST's tiling off and on, shardwise and DeepSpeed side by side.

One command runs everything, one launch after another (torchrun ``--standalone``, ``OMP_NUM_THREADS=1``
per rank): for each implementation and each SP degree ``N`` a gloo job of ``N`` ranks (so SP 1 is one
process, SP 4 four), each running ``bench_long_context_worker.py`` for tiling off and on. A separate
launch per degree because DeepSpeed's registration rewrites transformers' global ``"sdpa"`` attention
and its SP groups once per process. What is measured is memory, not time (the worker's docstring):
the bytes autograd saves for backward in one training forward that are still alive when the forward
returns, per rank, parameters excluded (the activations held across forward and backward), and the
heap's peak over one forward + backward (glibc ``mallinfo2``, which, unlike RSS, drops when tensors are
freed; it adds the backward's transients). The longest length in ``--budget-mib`` of saved bytes per
rank is found by measurement (probes bracketing the budget down to a granule of ``16 N`` tokens), then
trained once (forward + backward) to show it runs; a second search does the same against
``--heap-budget-mib`` of heap peak, every probe a training step. Seconds are wall time on a shared
machine (under load): in the JSON only.

DeepSpeed runs from another interpreter (``--ds-python``: a venv with ``deepspeed`` that sees this
one's packages); where ``import deepspeed`` fails there, its rows are left out with the reason.
``--deepspeed-from FILE`` reuses the DeepSpeed rows recorded in an earlier results file instead
(the JSON and the rendered tables say so, with that run's date).

examples:
  python benchmarks/long_context/bench_long_context.py --ds-python /work/dsvenv/bin/python
  python benchmarks/long_context/bench_long_context.py --impl shardwise --sp 1,2 --seqs 1024
  python benchmarks/long_context/bench_long_context.py --from-json benchmarks/results/long_context.json
  python benchmarks/long_context/bench_long_context.py --deepspeed-from benchmarks/results/long_context.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "bench_long_context_worker.py"
RESULTS = HERE.parent / "results" / "long_context.json"


def _env(python: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error",
               DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    venv = Path(python).parent.parent
    env.setdefault("TORCH_EXTENSIONS_DIR", str(venv / "torch_extensions"))  # DeepSpeed's JIT ops
    return env


def _deepspeed_missing(python: str) -> str | None:
    """None when ``python`` imports deepspeed, else why not (its last line of error)."""
    r = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
                       text=True, env=_env(python))
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["failed"])[-1]


def _launch(python: str, impl: str, sp: int, args: argparse.Namespace) -> list[dict]:
    """One torchrun job of ``sp`` ranks; its runs, or one entry holding the error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={sp}", str(WORKER),
               "--impl", impl, "--sp", str(sp), "--seqs", args.seqs, "--budget-mib", str(args.budget_mib),
               "--heap-budget-mib", str(args.heap_budget_mib), "--first", str(args.first), "--granule",
               str(args.granule), "--tiled", args.tiled, "--out", str(out)]
        print(f"[bench_long_context] {impl} SP {sp} ...", file=sys.stderr, flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True, env=_env(python), cwd=REPO)
        if r.returncode == 0 and out.exists():
            return json.loads(out.read_text())
    lines = [x for x in r.stderr.splitlines() if "Error" in x or "error" in x] or r.stderr.splitlines()[-3:]
    return [{"impl": impl, "sp": sp, "error": lines[-1] if lines else f"exit {r.returncode}",
             "stderr_tail": r.stderr[-4000:]}]


def run_all(args: argparse.Namespace) -> dict:
    from bench_long_context_worker import MODEL

    impls = args.impl.split(",")
    ds_python = args.ds_python or sys.executable
    skipped = {}
    if "deepspeed" in impls and not args.deepspeed_from and (why := _deepspeed_missing(ds_python)):
        skipped["deepspeed"] = f"not run: `import deepspeed` fails in {ds_python}: {why}"
        impls.remove("deepspeed")
    runs = []
    if args.deepspeed_from:  # DeepSpeed's rows as recorded by an earlier run of this benchmark, not re-run
        old = json.loads(Path(args.deepspeed_from).read_text())
        same = (old["meta"]["budget_MiB_per_rank"], old["meta"].get("heap_budget_MiB_per_rank"))
        if same != (args.budget_mib, args.heap_budget_mib):
            raise SystemExit(f"{args.deepspeed_from}: its DeepSpeed rows were searched in budgets {same} MiB, "
                             f"not {(args.budget_mib, args.heap_budget_mib)}: rerun DeepSpeed or match them")
        runs = [r for r in old["runs"] if r["impl"] == "deepspeed"]
        skipped["deepspeed"] = (f"not re-run: its rows are those recorded on {old['meta']['date']} "
                                f"({old['meta']['cpu']}), read from {args.deepspeed_from}")
        impls = [i for i in impls if i != "deepspeed"]
    for impl in impls:
        python = ds_python if impl == "deepspeed" else sys.executable
        for sp in (int(s) for s in args.sp.split(",")):
            runs.extend(_launch(python, impl, sp, args))
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": _cpu(),
            "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "model": MODEL,
            "budget_MiB_per_rank": args.budget_mib, "heap_budget_MiB_per_rank": args.heap_budget_mib,
            "load_avg_at_end": os.getloadavg(), "skipped": skipped,
            "counted": "live saved-for-backward bytes at the end of one training forward, per rank (max over "
                       "ranks), parameters excluded, each storage once (bench_long_context_worker.py)",
            "search": "measured probes bracketing the budget (--first x SP tokens, twice that if it fits, then "
                      "where the line through the nearest measured points crosses the budget, bisecting when a "
                      "step did not halve the bracket) until L fits and L + granule does not; "
                      "then one forward + backward at L (train_check)",
            "timings": "wall seconds (seconds fields) on a shared 2-core machine: measured under load, one run "
                       "each: not a speed comparison"}
    return {"meta": meta, "runs": runs}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "?")
    except OSError:
        return "?"


def _ok(runs: list[dict]) -> list[dict]:
    return [r for r in runs if "error" not in r]


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def bytes_table(runs: list[dict]) -> list[str]:
    """Per rank at each fixed length: live saved MiB / heap peak MiB over forward + backward."""
    seqs = sorted({row["seq"] for r in _ok(runs) for row in r["rows"]})
    out = ["| SP | ALST tiling | impl | " + " | ".join(f"{s} tok" for s in seqs) + " | largest saved tensor at "
           f"{seqs[-1] if seqs else '-'} |", "| ---: | --- | --- | " + "---: | " * (len(seqs) + 1)]
    for r in sorted(_ok(runs), key=lambda r: (r["sp"], r["tiled"], r["impl"])):
        by = {row["seq"]: row for row in r["rows"]}
        cells = [f"{by[s]['live_MiB']:.1f} / {_mib(by[s].get('heap_peak_MiB'))}" if s in by else "-" for s in seqs]
        last = f"{by[seqs[-1]]['largest_MiB']:.1f}" if seqs and seqs[-1] in by else "-"
        out.append(f"| {r['sp']} | {'on' if r['tiled'] else 'off'} | {r['impl']} | " + " | ".join(cells) +
                   f" | {last} |")
    return out


def _times(r: dict, key: str, base: dict) -> str:
    b = base.get((r["impl"], key))
    return f"{r[key[0]] / b:.2f}" if b and r.get(key[0]) is not None else "-"


def longest_table(runs: list[dict]) -> list[str]:
    """The longest length per (SP, tiling, impl) by counted bytes and by heap peak, and as multiples of
    the same implementation's SP 1 untiled length."""
    ok = _ok(runs)
    base = {(r["impl"], (k, False)): r.get(k) for r in ok if r["sp"] == 1 and not r["tiled"]
            for k in ("longest", "heap_longest")}
    out = ["| SP | ALST tiling | impl | longest by saved bytes (tokens) | x SP 1 untiled | saved MiB there | "
           "heap peak MiB there | longest by heap peak (tokens) | x SP 1 untiled |",
           "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(ok, key=lambda r: (r["sp"], r["tiled"], r["impl"])):
        chk = r["train_check"] or {}
        out.append(f"| {r['sp']} | {'on' if r['tiled'] else 'off'} | {r['impl']} | {r['longest']} | "
                   f"{_times(r, ('longest', False), base)} | {_mib(chk.get('live_MiB'))} | "
                   f"{_mib(chk.get('heap_peak_MiB'))} | {r.get('heap_longest', '-')} | "
                   f"{_times(r, ('heap_longest', False), base)} |")
    return out


def _peak_points(r: dict) -> list[tuple[int, float]]:
    """(tokens per rank, heap peak MiB) of every training step the run measured, by length."""
    rows = [x for x in r["rows"] + r.get("heap_probes", []) if x.get("heap_peak_MiB") is not None]
    return sorted({x["seq"] // r["sp"]: x["heap_peak_MiB"] for x in rows}.items())


def peak_table(runs: list[dict]) -> list[str]:
    """Tokens per rank against heap peak, every measured training step, and the least-squares line
    through them (fixed MiB + MiB per 1,000 tokens per rank) to read a budget's length off."""
    out = ["| SP | ALST tiling | impl | tokens per rank: heap peak MiB (measured) | line: MiB + MiB per 1k tokens | "
           "worst miss of the line |", "| ---: | --- | --- | --- | ---: | ---: |"]
    for r in sorted(_ok(runs), key=lambda r: (r["sp"], r["tiled"], r["impl"])):
        pts = _peak_points(r)
        if len(pts) < 2:
            continue
        n, mx, my = len(pts), sum(t for t, _ in pts) / len(pts), sum(m for _, m in pts) / len(pts)
        slope = sum((t - mx) * (m - my) for t, m in pts) / max(sum((t - mx) ** 2 for t, _ in pts), 1e-9)
        fixed = my - slope * mx
        miss = max(abs(m - fixed - slope * t) / m for t, m in pts)
        cells = ", ".join(f"{t}: {m:.0f}" for t, m in pts)
        out.append(f"| {r['sp']} | {'on' if r['tiled'] else 'off'} | {r['impl']} | {cells} | "
                   f"{fixed:.0f} + {1000 * slope:.1f} | {100 * miss:.0f}% ({n} points) |")
    return out


def render(result: dict) -> str:
    meta, runs = result["meta"], result["runs"]
    lines = [f"`{meta['command']}` ({meta['date']}, {meta['cpu']}; {meta['model']}; budget "
             f"{meta['budget_MiB_per_rank']:g} MiB per rank)", "",
             "MiB per rank against sequence length: live saved-for-backward bytes / heap peak over one "
             "forward + backward:", "", *bytes_table(runs), "",
             f"Longest sequence whose saved bytes fit {meta['budget_MiB_per_rank']:g} MiB per rank, and whose heap "
             f"peak fits {meta.get('heap_budget_MiB_per_rank', 0):g} MiB per rank (both measured):", "",
             *longest_table(runs), "", "Heap peak per rank against tokens per rank (every training step "
             "measured, and a line through them):", "", *peak_table(runs)]
    for impl, why in meta.get("skipped", {}).items():
        lines += ["", f"{impl}: {why}"]
    for r in runs:
        if "error" in r:
            lines += ["", f"{r['impl']} SP {r['sp']} failed: `{r['error']}`"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("examples:")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="shardwise,deepspeed", help="comma list of shardwise, deepspeed")
    p.add_argument("--ds-python", default=os.environ.get("DS_PYTHON"),
                   help="interpreter that imports deepspeed (default: $DS_PYTHON, else this one)")
    p.add_argument("--sp", default="1,2,4", help="SP degrees, one launch of that many ranks each")
    p.add_argument("--seqs", default="1024,2048,4096", help="fixed lengths for the bytes table")
    p.add_argument("--budget-mib", type=float, default=128.0, help="activation budget per rank")
    p.add_argument("--heap-budget-mib", type=float, default=384.0,
                   help="budget per rank for the second search, by the heap's peak over forward + backward (0: off)")
    p.add_argument("--first", type=int, default=512, help="the search's first probe, tokens per rank")
    p.add_argument("--granule", type=int, default=16, help="the search's resolution, tokens per rank")
    p.add_argument("--tiled", default="off,on")
    p.add_argument("--out", default=str(RESULTS), help="raw results (JSON)")
    p.add_argument("--from-json", help="print the tables of a results file; run nothing")
    p.add_argument("--deepspeed-from", help="a results file whose DeepSpeed rows are reused (and said so in "
                   "the JSON's meta.skipped) instead of running DeepSpeed; the rest runs")
    args = p.parse_args()
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text())))
        return
    result = run_all(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(render(result))


if __name__ == "__main__":
    main()
