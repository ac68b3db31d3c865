"""One-command check of shardwise on one NVIDIA GPU (at most ~10 minutes): writes a JSON and a markdown table.

    python benchmarks/gpu_check.py                      # on the GPU machine: every section
    python benchmarks/gpu_check.py --smoke              # anywhere, tiny sizes, CUDA-only sections skipped
    python benchmarks/gpu_check.py --only stages,offload_bandwidth --out /tmp/gc

Sections (``benchmarks/gpu/sections.py`` and the files it imports), each in its own process with its
own time limit, so that a hang, a crash or an out-of-memory in one still leaves the others' results:

* ``stages``: NCCL at world 1 and ZeRO stages 0-3 (fp32 and bf16, optimizer offload at stage 2, parameter
  offload at stage 3) against plain PyTorch, fp32 held to a multiple of torch's own AdamW spread
  (default / fused / foreach off) measured in the same run on the same model and batches;
* ``determinism``: three identical runs of every stage and offload mode, bitwise;
* ``offload_bandwidth``: host<->device copy bandwidth from pinned and from pageable memory;
* ``checkpoint_offload``: ALST's activation-checkpoint offload (``gpu/long_context.py``);
* ``parallel``: TP, SP (Ulysses and ring) and EP at degree 1 through their code paths, against plain torch;
* ``checkpoint``: save, load into other weights, one more step, consolidate: all bitwise;
* ``train``: the main job, ``shardwise train --run-config examples/sonnets.toml``: loss falls, tokens/s;
* ``step_vs_fsdp2``: bf16 step time, peak memory and MFU of shardwise ZeRO-3, FSDP2 and torch's own
  single-GPU baseline on a ~1B Llama, interleaved rounds (one process per run, so each peak is its own);
* ``precision``: DeepSpeed's low-precision master modes at ZeRO-3 beside FSDP2 with the same precision
  policy (``gpu/precision.py``): peak allocated per mode, its fraction of fp32 masters', the loss
  after a few steps against fp32 masters';
* ``zero_inference``: tokens/s of ZeRO-Inference streaming a ~13B random-weight Llama from CPU
  memory against the copy limit it measures (the weights are written once under ``--workdir``).

Then the goals (``gpu/goals.py``): met, not met or not measured, with the numbers, at the top
of the markdown and under ``goals`` in the JSON. docs/gpu_check.md says more.

A section is ``ok``, ``partial`` (a row failed, its error in the row), ``skipped`` (with the reason, e.g.
no CUDA), ``error`` (the tail of its stderr) or ``timeout``. ``--smoke`` runs the same code at tiny sizes
on CPU (gloo), all sections in this one process (``--isolate``: one each, as on the GPU machine); the test
suite runs it (tests/test_gpu_check.py). The total stays within ``--budget-s``: each section gets at most
its own limit and what is left of the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback

from shared.machine import cpu_model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# (name, seconds at most on the GPU machine); the sum is 600 s, over the 540 s default budget
# (the device machine's one command runs at most 600 s: 60 s kept for start-up and the report), so the
# last section (precision, the newest) gets what is left. Measured on an H200 at
# e6c7cdc: stages 14-17 s, offload_bandwidth 5, checkpoint_offload 13, step_vs_fsdp2 50-67 (4 runs; 6 now),
# zero_inference 72 (the 13B model's write included); the new sections are estimates with room (precision:
# 7 fresh processes of a 1B model, ~15 s each expected)
SECTIONS = [("stages", 50), ("determinism", 50), ("offload_bandwidth", 15), ("checkpoint_offload", 15),
            ("parallel", 35), ("checkpoint", 30), ("train", 60), ("step_vs_fsdp2", 125), ("zero_inference", 100),
            ("precision", 120)]



def environment() -> dict:
    """What ran: date, machine, versions, the GPU (None without CUDA)."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpu": gpu, "git": _git_rev()}


def _git_rev() -> str | None:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_section(name: str, smoke: bool, limit_s: float, workdir: str) -> dict:
    """One section in a child process; its JSON result, or why there is none."""
    if limit_s < 5:
        return {"status": "skipped", "reason": "no time left in the budget"}
    result = os.path.join(workdir, f"section_{name}.json")
    if os.path.exists(result):
        os.remove(result)
    # --deadline: the child's own clock starts after Python and torch are up, this one now
    cmd = [sys.executable, os.path.join(HERE, "sections.py"), name, "--result", result,
           "--workdir", workdir, "--deadline", str(time.time() + limit_s)] + (["--smoke"] if smoke else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    t0 = time.monotonic()
    # its own process group: at the limit the runs it started (step_vs_fsdp2's) go too, not only
    # the section, so no orphan keeps the GPU busy under the next section
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it may have just ended on its own
            os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        return {"status": "timeout", "limit_s": limit_s, "stderr_tail": stderr[-1500:], "partial": _read(result)}
    out = _read(result)
    if proc.returncode != 0 or out is None:
        return {"status": "error", "returncode": proc.returncode, "stderr_tail": stderr[-1500:], "partial": out}
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def run_in_process(name: str, smoke: bool, limit_s: float, workdir: str) -> dict:
    """One section in this process (``--smoke``: one import of torch for all; no time limit)."""
    from gpu import sections

    t0 = time.monotonic()
    try:
        out = sections.SECTIONS[name](smoke, workdir, limit_s)
    except Exception:  # noqa: BLE001 - one failed section must not hide the others
        return {"status": "error", "stderr_tail": traceback.format_exc()[-1500:]}
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def markdown(report: dict) -> str:
    """The report as markdown: the machine, then one table per section."""
    env = report["environment"]
    lines = [f"# shardwise GPU check ({'smoke, ' if report['smoke'] else ''}{env['date_utc']})", "",
             f"GPU: {env['gpu'] or 'none'}; CPU: {env['cpu']} ({env['cpu_count']} cores); torch {env['torch']} "
             f"(CUDA {env['cuda']}); shardwise {env['git']}; command: `{report['command']}`", ""]
    if report.get("goals"):
        from gpu.goals import markdown_lines

        lines += markdown_lines(report["goals"])
    for name, res in report["sections"].items():
        lines += [f"## {name}: {res['status']}" + (f" ({res['wall_s']} s)" if "wall_s" in res else ""), ""]
        if res.get("reason"):
            lines += [res["reason"], ""]
        if res.get("stderr_tail"):
            lines += ["```", res["stderr_tail"].strip()[-800:], "```", ""]
        rows = res.get("rows") or (res.get("partial") or {}).get("rows") or []
        if rows:
            cols = list(dict.fromkeys(k for r in rows for k in r))
            lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
            lines.append("")
        for note in res.get("notes", []):
            lines += [f"- {note}"]
        if res.get("notes"):
            lines.append("")
    return "\n".join(lines)


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def main(argv: list[str] | None = None) -> int:
    from gpu.goals import goals

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs without a GPU (CUDA sections skipped)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="folder for the JSON/markdown")
    p.add_argument("--workdir", default=None, help="scratch folder (the 13B random model is kept here for reuse); "
                   "default: /tmp/shardwise_gpu_check (smoke: under --out)")
    p.add_argument("--only", default=None, help="comma-separated section names")
    p.add_argument("--budget-s", type=float, default=540.0, help="total seconds for every section together")
    p.add_argument("--isolate", action="store_true", help="with --smoke: one process per section, as without it")
    args = p.parse_args(argv)
    names = [n for n, _ in SECTIONS]
    chosen = args.only.split(",") if args.only else names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        p.error(f"--only: unknown section(s) {unknown}; sections: {names}")
    workdir = args.workdir or (os.path.join(args.out, "gpu_check_work") if args.smoke else "/tmp/shardwise_gpu_check")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(workdir, exist_ok=True)
    start = time.monotonic()
    report = {"smoke": args.smoke, "command": " ".join(["python", "benchmarks/gpu_check.py", *sys.argv[1:]]),
              "environment": environment(), "sections": {}}
    stem = os.path.join(args.out, "gpu_check_smoke" if args.smoke else "gpu_check")
    for name, limit in SECTIONS:
        if name not in chosen:
            continue
        left = args.budget_s - (time.monotonic() - start)
        run = run_in_process if args.smoke and not args.isolate else run_section
        try:
            report["sections"][name] = run(name, args.smoke, min(limit if not args.smoke else 240, left), workdir)
        except Exception:  # noqa: BLE001 - e.g. no process could be started: the report still gets written
            report["sections"][name] = {"status": "error", "stderr_tail": traceback.format_exc()[-1500:]}
        print(f"{name}: {report['sections'][name]['status']}", flush=True)
        report["goals"] = goals(report)
        write_report(report, stem)  # after each section: a run killed from outside keeps what it finished
    for g in report["goals"]:
        print(f"goal: {g['goal']}: {({True: 'met', False: 'NOT MET', None: 'not measured'})[g['met']]} "
              f"({g['measured']})")
    print(f"wrote {stem}.json and .md ({time.monotonic() - start:.0f} s)")
    return 0


def write_report(report: dict, stem: str) -> None:
    """The JSON and the markdown, rewritten whole each time (what any reader finds is a complete report)."""
    with open(f"{stem}.json", "w") as f:
        json.dump(report, f, indent=1)
    with open(f"{stem}.md", "w") as f:
        f.write(markdown(report) + "\n")
