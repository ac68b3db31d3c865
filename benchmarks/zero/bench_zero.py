"""Side-by-side ZeRO benchmark: shardwise vs torch DDP, FSDP2 and DeepSpeed on one ~20M Llama.

One invocation launches, one after another, a multi-rank gloo job (torchrun, OMP_NUM_THREADS=1 per
rank) per mode. Every job trains the same model (``llama-20m`` from ``shardwise.cli.train_job``, same
seed) on the same batches with the same AdamW hyperparameters (torch's fused AdamW everywhere, no
gradient clipping) and reports:

* step time: forward + backward + optimizer step per iteration, the slowest rank's time per step,
  median over the measured steps (after warmup); forward/backward/step split as well;
* model-state memory per rank: tensor bytes (not RSS: glibc keeps freed memory) of every live tensor
  storage the job created (params, grads, fp32 masters, optimizer state, framework buffers),
  taken right after a backward (grads present) and deduplicated by storage;
* the loss of the last step (fp32 modes see identical data and weights, so it must agree).

Results go to ``benchmarks/results/latest.json`` and, as a markdown table with the machine, the
command and an interpretation, to ``docs/benchmarks.md``.

examples:
  python benchmarks/zero/bench_zero.py                                  # everything, 2 ranks
  python benchmarks/zero/bench_zero.py --steps 10 --warmup 3 --modes ddp,sw2,ds2
  python benchmarks/zero/bench_zero.py --profile sw3                    # where a mode's time goes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_report as report  # noqa: E402  (modes, constants, the table and the doc)
from bench_report import ADAMW, DOC, MODES, REPO, RESULTS  # noqa: E402
from bench_zero_worker import shared_zero_section  # noqa: E402

# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
WORKER = Path(__file__).resolve().parent / "bench_zero_worker.py"  # one rank of one mode
SRC = [REPO]  # the folder whose `shardwise` package the jobs import (--src)


def _src_hash() -> str:
    """A hash of the benchmarked shardwise sources (to detect edits during a run)."""
    import hashlib

    h = hashlib.sha1()
    for f in sorted((SRC[0] / "shardwise").rglob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def _src_version() -> str:
    if SRC[0] != REPO:  # a snapshot: no commit of its own (name it with --note)
        return f"{SRC[0]} (sources {_src_hash()})"
    r = subprocess.run(["git", "-C", str(SRC[0]), "describe", "--always", "--dirty"], capture_output=True,
                       text=True)
    commit = r.stdout.strip() if r.returncode == 0 else "not a git checkout"
    return f"{SRC[0]} ({commit}, sources {_src_hash()})"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["TORCH_EXTENSIONS_DIR"] = str(REPO / ".cache" / "torch_extensions")
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONWARNINGS"] = "ignore"
    env["TRANSFORMERS_VERBOSITY"] = "error"
    env["BENCH_SHARDWISE_SRC"] = str(SRC[0])
    return env


def _deepspeed_status() -> str | None:
    """None when ``import deepspeed`` works, else the reason."""
    r = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True,
                       env=_env(), timeout=300)
    if r.returncode == 0:
        return None
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit {r.returncode}"


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return float("nan")


def run_mode(mode: str, args, out_dir: Path, profile_dir: str | None = None, worker: Path = WORKER) -> dict:
    """One gloo job of ``mode`` (``worker`` run by torchrun on every rank); its results, or why it failed."""
    out = out_dir / f"{mode}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(worker), "--mode", mode, "--out", str(out), "--seq", str(args.seq), "--micro", str(args.micro),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed), "--model", args.model]
    if profile_dir:
        cmd += ["--profile-dir", profile_dir]
    load0, t0 = _loadavg(), time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=args.job_timeout,
                           cwd=REPO)
        ok, err = r.returncode == 0 and out.exists(), r.stderr
    except subprocess.TimeoutExpired as e:
        ok, err = False, f"timed out after {args.job_timeout}s\n{(e.stderr or b'')[-2000:]!r}"
    wall = time.perf_counter() - t0
    if not ok:
        lines = [ln for ln in (err or "").splitlines() if ln.strip() and "Warning" not in ln]
        reason = next((ln for ln in lines if ln.startswith("[rank") and "Error:" in ln),
                      next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "failed"))
        (out_dir / f"{mode}.stderr.txt").write_text(err or "")
        return {"mode": mode, "error": reason.strip()[:300], "wall_s": wall}
    res = json.loads(out.read_text())
    res.update(wall_s=wall, loadavg_before=load0, loadavg_after=_loadavg())
    return res


def parser() -> argparse.ArgumentParser:
    """The command line (also what ``bench_waits.py`` hands ``run_mode``, with its defaults)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks per job (default 2)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps first")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--micro", type=int, default=4, help="micro batch per rank")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--model", default="llama-20m", help="preset or config.json (shardwise train --model; "
                   "benchmarks/zero/bench_scaling.py passes its sizes this way)")
    p.add_argument("--offload-optimizer", action="store_true", help="offload_optimizer to the CPU in every "
                   "shardwise and DeepSpeed mode (DeepSpeed then steps with its DeepSpeedCPUAdam)")
    p.add_argument("--results-json", type=Path, default=None, help="write the raw results here instead of "
                   "benchmarks/results/latest.json")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, round-robin (median taken)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    p.add_argument("--profile", metavar="MODE", help="profile one mode with torch.profiler and print "
                   "the top ops of rank 0 (no table, no doc)")
    p.add_argument("--job-timeout", type=int, default=900, help="seconds before a job is killed")
    p.add_argument("--src", type=Path, default=REPO, help="folder holding the shardwise package to "
                   "benchmark (default: this checkout); e.g. a `git archive` snapshot while the tree changes")
    p.add_argument("--from-json", type=Path, help="only re-render docs/benchmarks.md from a saved "
                   "results file (benchmarks/results/latest.json)")
    p.add_argument("--note", default="", help="free text for the doc's contention line")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)

    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        results, meta = saved["results"], saved["meta"]
        meta["interpretation"] = report.interpret(results)
        tbl, checks = report.table(results), report.verdicts(results)
        print(tbl + "\n\n" + "\n".join(checks))
        report.write_doc(results, meta, tbl, checks)
        return 0

    SRC[0] = args.src.resolve()
    if args.offload_optimizer:
        os.environ["BENCH_OFFLOAD_OPTIMIZER"] = "1"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_zero_"))

    if args.profile:
        prof_dir = tmp / "profile"
        prof_dir.mkdir()
        r = run_mode(args.profile, args, tmp, profile_dir=str(prof_dir))
        if "error" in r:
            print(f"{args.profile} failed: {r['error']}")
            return 1
        print(f"{args.profile}: median step {r['step_ms_median']:.0f} ms (fwd {r['fwd_ms']:.0f} / "
              f"bwd {r['bwd_ms']:.0f} / opt {r['opt_ms']:.0f}); comm {r.get('comm_stats')}")
        print((prof_dir / "profile_rank0.txt").read_text())
        print(f"chrome traces: {prof_dir}")
        return 0

    ds_reason = None
    if any(MODES[m][0] == "deepspeed" for m in modes):
        ds_reason = _deepspeed_status()
        if ds_reason:
            print(f"[bench] DeepSpeed skipped: import deepspeed failed: {ds_reason}", flush=True)
    version = _src_version()
    print(f"[bench] shardwise from {version}", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    loads = []
    for rep in range(args.repeats):
        for m in modes:
            if MODES[m][0] == "deepspeed" and ds_reason:
                runs[m] = [{"mode": m, "error": f"import deepspeed failed ({ds_reason})"}]
                continue
            r = run_mode(m, args, tmp)
            runs[m].append(r)
            if "error" in r:
                print(f"[bench] {m} (repeat {rep + 1}): FAILED: {r['error']}", flush=True)
            else:
                loads.append(r["loadavg_before"])
                print(f"[bench] {m} (repeat {rep + 1}): {r['step_ms_median']:.0f} ms/step (fwd "
                      f"{r['fwd_ms']:.0f} / bwd {r['bwd_ms']:.0f} / opt {r['opt_ms']:.0f}), model "
                      f"states {max(r['model_state_bytes']) / 2**20:.1f} MiB/rank, loss "
                      f"{r['loss_last_timed']:.4f}, load {r['loadavg_before']:.1f}, job {r['wall_s']:.0f} s",
                      flush=True)
    changed = _src_hash() not in version
    if changed:
        print("[bench] WARNING: the shardwise sources changed during the run; the rows may mix versions",
              flush=True)
    results = {m: report._merge(rs) for m, rs in runs.items()}
    tbl = report.table(results)
    checks = report.verdicts(results)
    print()
    print(tbl)
    print()
    print("\n".join(checks))

    import torch

    try:
        import transformers
        tv = transformers.__version__
    except ImportError:  # pragma: no cover
        tv = "?"
    dsv = "not installed"
    if not ds_reason:
        r = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
                           capture_output=True, text=True, env=_env())
        dsv = (r.stdout.strip().splitlines() or ["?"])[-1]
    params = next((r["params"] for r in results.values() if "params" in r), 0)
    cpu = platform.processor() or platform.machine()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import shlex

    shown = shlex.join(["python", "benchmarks/zero/bench_zero.py"] + (argv if argv is not None else sys.argv[1:]))
    meta = {
        "command": shown, "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{cpu}, {os.cpu_count()} cores visible, {platform.system()} {platform.release()}",
        "software": f"python {platform.python_version()}, torch {torch.__version__}, transformers {tv}, "
                    f"DeepSpeed {dsv}",
        "shardwise": version + (" — WARNING: the sources changed during the run" if changed else ""),
        "params": params, "seq": args.seq, "micro": args.micro, "nproc": args.nproc, "warmup": args.warmup,
        "steps": args.steps, "repeats": args.repeats,
        "adamw": ", ".join(f"{k}={v}" for k, v in ADAMW.items()),
        "zero": json.dumps(shared_zero_section()),
        "contention": (f"the box has {os.cpu_count()} cores and {args.nproc} single-threaded ranks fill "
                       f"them; other jobs shared it (1-min load average before each job: "
                       f"{min(loads, default=float('nan')):.1f}-{max(loads, default=float('nan')):.1f}), "
                       f"so one job's median can move by 2x between "
                       f"repeats (see the per-repeat column): trust large gaps and the memory and loss "
                       f"columns, not differences of 10-20%. {args.note}").strip(),
        "interpretation": report.interpret(results),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (args.results_json or RESULTS / "latest.json").write_text(json.dumps({"meta": meta, "results": results,
                                                                          "runs": runs}, indent=1))
    if not args.no_doc:
        report.write_doc(results, meta, tbl, checks)
        print(f"\nwrote {DOC.relative_to(REPO)} and {(RESULTS / 'latest.json').relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
