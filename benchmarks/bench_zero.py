"""Side-by-side ZeRO benchmark: shardwise vs torch DDP, FSDP2 and DeepSpeed on one ~20M Llama.

One invocation launches, one after another, a multi-rank gloo job (torchrun, OMP_NUM_THREADS=1 per
rank) per mode. Every job trains the same model (``llama-20m`` from ``shardwise.train_job``, same
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
  python benchmarks/bench_zero.py                                  # everything, 2 ranks
  python benchmarks/bench_zero.py --steps 10 --warmup 3 --modes ddp,sw2,ds2
  python benchmarks/bench_zero.py --profile sw3                    # where a mode's time goes
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_report as report  # noqa: E402  (modes, constants, the table and the doc)
from bench_report import ADAMW, BUCKET, DOC, MODES, REPO, RESULTS  # noqa: E402


# ----------------------------------------------------------------------------------------------
# worker (one rank of one mode)
# ----------------------------------------------------------------------------------------------
def _live_storages() -> dict[int, int]:
    """data_ptr -> bytes of every tensor storage Python can reach (DTensors by their local shard)."""
    import torch

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()  # noqa: N806
    out: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        try:
            t = obj.to_local() if isinstance(obj, DTensor) else obj
            if t.device.type == "meta":
                continue
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
        except Exception:  # noqa: BLE001 - wrapper subclasses without storage, freed storages
            continue
        if n and ptr:
            out[ptr] = max(out.get(ptr, 0), n)
    return out


def _model_state_bytes(baseline: dict[int, int]) -> int:
    gc.collect()
    return sum(n for ptr, n in _live_storages().items() if ptr not in baseline)


class Runner:
    """forward(batch) -> loss, backward(loss), step(); built per framework."""

    def __init__(self, fwd, bwd, step, report=None, comm=None):
        self.forward, self.backward, self.step = fwd, bwd, step
        self.report, self.comm = report, comm


def _build_ddp(model, args):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(ddp.parameters(), fused=True, **ADAMW)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=False)

    return Runner(lambda b: ddp(**b).loss, lambda loss: loss.backward(), step)


def _build_fsdp2(model, precision):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return _plain_loop(model, torch.optim.AdamW(model.parameters(), fused=True, **ADAMW))


def _build_shardwise_fn(model, stage, precision):
    """shardwise's functional API in FSDP2's loop: shard(), then any torch optimizer on the shards."""
    import torch

    import shardwise

    model = shardwise.shard(model, stage=stage, mixed_precision=precision, bucket_size=BUCKET, overlap_comm=True)
    opt = shardwise.ShardedOptimizer(model, torch.optim.AdamW, fused=True, **ADAMW)
    return _plain_loop(model, opt, comm=lambda: model.sharding.comm.stats.as_dict())


def _plain_loop(model, opt, **kw) -> Runner:
    """model(**b).loss; loss.backward(); opt.step(); opt.zero_grad()."""
    def step():
        opt.step()
        opt.zero_grad()

    return Runner(lambda b: model(**b).loss, lambda loss: loss.backward(), step, **kw)


def _offload() -> bool:
    """``--offload-optimizer`` (passed to the ranks as BENCH_OFFLOAD_OPTIMIZER=1)."""
    return os.environ.get("BENCH_OFFLOAD_OPTIMIZER") == "1"


def _ds_config(stage: int, precision: str, micro: int) -> dict:
    """The config keys shardwise's engine and DeepSpeed share."""
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    if _offload() and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "steps_per_print": 10**9, "bf16": {"enabled": precision == "bf16"},
            "zero_optimization": zero}


def _build_shardwise(model, stage, precision, micro):
    import shardwise

    cfg = {**_ds_config(stage, precision, micro),
           "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}}}
    engine, *_ = shardwise.initialize(model=model, config=cfg)

    def fwd(b):
        return engine(**b).loss

    return Runner(fwd, engine.backward, engine.step, report=engine.memory_report, comm=engine.comm_stats)


def _build_deepspeed(model, stage, precision, micro):
    import deepspeed
    import torch

    cfg = {**_ds_config(stage, precision, micro), "wall_clock_breakdown": False,
           "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    if _offload():  # DeepSpeed's own offload path: its config AdamW becomes DeepSpeedCPUAdam
        cfg["optimizer"] = {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

    def fwd(b):
        return engine(**b).loss

    return Runner(fwd, engine.backward, engine.step)


def _import_shardwise_from(src: str) -> None:
    """Make ``import shardwise`` load ``src/shardwise`` (ahead of an editable install's finder)."""
    import importlib.util

    pkg = Path(src) / "shardwise"
    spec = importlib.util.spec_from_file_location("shardwise", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["shardwise"] = mod
    spec.loader.exec_module(mod)


def worker(args) -> None:
    if os.environ.get("BENCH_SHARDWISE_SRC"):
        _import_shardwise_from(os.environ["BENCH_SHARDWISE_SRC"])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    framework, stage, precision = MODES[args.worker]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from shardwise.train_job import REPO_DATA, ByteTextDataset, build_model

    dataset = ByteTextDataset(REPO_DATA, args.seq)
    gc.collect()
    baseline = _live_storages()
    if args.model.endswith(".json"):  # a size of bench_scaling.py: a Llama config, byte-level vocabulary
        from shardwise.train.model import ModelSource
        from shardwise.train.model import build_model as build_from_source

        model = build_from_source(ModelSource("config", args.model, Path(args.model)), 256, args.seq, args.seed, 0)
    else:
        model = build_model(args.model, args.seq, args.seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    if framework == "ddp":
        runner = _build_ddp(model, args)
    elif framework == "fsdp2":
        runner = _build_fsdp2(model, precision)
    elif framework == "shardwise":
        runner = _build_shardwise(model, stage, precision, args.micro)
    elif framework == "shardwise-fn":
        runner = _build_shardwise_fn(model, stage, precision)
    else:
        runner = _build_deepspeed(model, stage, precision, args.micro)

    def batch(i: int) -> dict:
        g = torch.Generator().manual_seed(args.seed * 1000 + i)
        idx = torch.randint(len(dataset), (world * args.micro,), generator=g)[rank * args.micro:]
        ids = torch.stack([dataset[int(j)]["input_ids"] for j in idx[:args.micro]])
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    prof = None
    if args.profile_dir:
        from torch.profiler import ProfilerActivity, profile, schedule

        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False,
                       schedule=schedule(wait=0, warmup=args.warmup, active=args.steps, repeat=1))
        prof.start()
    times, losses = [], []
    total = args.warmup + args.steps
    for i in range(total + 1):
        b = batch(i)
        dist.barrier()
        t0 = time.perf_counter()
        loss = runner.forward(b)
        t1 = time.perf_counter()
        runner.backward(loss)
        t2 = time.perf_counter()
        if i == total:  # one extra, untimed step: model states with grads present
            mem_after_backward = _model_state_bytes(baseline)
            report_after_backward = runner.report() if runner.report else None
        runner.step()
        t3 = time.perf_counter()
        losses.append(float(loss.detach().float()))
        if i < total:
            times.append((t1 - t0, t2 - t1, t3 - t2))
        if prof is not None and i < total:
            prof.step()
    mem_after_step = _model_state_bytes(baseline)
    if prof is not None:
        prof.stop()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        Path(args.profile_dir, f"profile_rank{rank}.txt").write_text(table)
        prof.export_chrome_trace(str(Path(args.profile_dir, f"trace_rank{rank}.json")))

    mine = {"rank": rank, "times": times, "losses": losses, "mem_after_backward": mem_after_backward,
            "mem_after_step": mem_after_step, "memory_report": report_after_backward,
            "comm_stats": runner.comm() if runner.comm else None}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        steps = [max(r["times"][i][0] + r["times"][i][1] + r["times"][i][2] for r in every)
                 for i in range(args.warmup, total)]
        split = [statistics.median(r["times"][i][k] for i in range(args.warmup, total) for r in every)
                 for k in range(3)]
        out = {
            "mode": args.worker, "framework": framework, "stage": stage, "precision": precision,
            "params": n_params, "world": world, "micro": args.micro, "seq": args.seq,
            "step_ms_median": 1e3 * statistics.median(steps), "step_ms_min": 1e3 * min(steps),
            "step_ms_all": [round(1e3 * s, 2) for s in steps],
            "fwd_ms": 1e3 * split[0], "bwd_ms": 1e3 * split[1], "opt_ms": 1e3 * split[2],
            "model_state_bytes": [max(r["mem_after_backward"], r["mem_after_step"]) for r in every],
            "memory_report": [r["memory_report"] for r in every],
            "comm_stats": every[0]["comm_stats"], "threads": torch.get_num_threads(),
            "loss_last_timed": losses[total - 1], "losses": losses[:total],
        }
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
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


def run_mode(mode: str, args, out_dir: Path, profile_dir: str | None = None) -> dict:
    out = out_dir / f"{mode}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(Path(__file__).resolve()), "--worker", mode, "--out", str(out), "--seq", str(args.seq),
           "--micro", str(args.micro), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--seed", str(args.seed), "--model", args.model]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks per job (default 2)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps first")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--micro", type=int, default=4, help="micro batch per rank")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--model", default="llama-20m", help="preset or config.json (shardwise train --model; "
                   "benchmarks/bench_scaling.py passes its sizes this way)")
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
    # internal: one rank of one mode (started by torchrun)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--profile-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        worker(args)
        return 0
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

    shown = shlex.join(["python", "benchmarks/bench_zero.py"] + (argv if argv is not None else sys.argv[1:]))
    meta = {
        "command": shown, "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{cpu}, {os.cpu_count()} cores visible, {platform.system()} {platform.release()}",
        "software": f"python {platform.python_version()}, torch {torch.__version__}, transformers {tv}, "
                    f"DeepSpeed {dsv}",
        "shardwise": version + (" — WARNING: the sources changed during the run" if changed else ""),
        "params": params, "seq": args.seq, "micro": args.micro, "nproc": args.nproc, "warmup": args.warmup,
        "steps": args.steps, "repeats": args.repeats,
        "adamw": ", ".join(f"{k}={v}" for k, v in ADAMW.items()),
        "zero": json.dumps({k: v for k, v in _ds_config(0, "fp32", 1)["zero_optimization"].items() if k != "stage"}),
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
