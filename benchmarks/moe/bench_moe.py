"""Expert parallelism: step time and per-rank memory of a small MoE, shardwise and DeepSpeed side by side.

    python benchmarks/moe/bench_moe.py --ds-python /work/dsvenv/bin/python   # 2 gloo ranks, 6 modes
    python benchmarks/moe/bench_moe.py --impl shardwise --rounds 5 --experts 16
    python benchmarks/moe/bench_moe.py --from-json benchmarks/results/moe.json   # print the tables only

One job of 2 ranks (torchrun, OMP_NUM_THREADS=1 each) builds the same Mixtral-style model (fp32,
AdamW, weight decay 0, gradient clipping at 1.0 set explicitly for every mode) once per mode:
shardwise at ZeRO-2 and ZeRO-3, each without EP (every rank holds, or shards, every expert) and
with EP 2 (each rank holds half the experts), and DeepSpeed (AutoEP, its ``expert_parallel`` keys)
at ZeRO-2 without EP and with EP 2, in the *same* processes, so the modes are timed in interleaved
rounds and a busy machine slows every mode alike. DeepSpeed runs there because the job's
interpreter is ``--ds-python`` (a venv with ``deepspeed`` that sees this one's packages); its
AutoEP needs one patch with transformers 5.24 (``bench_moe_deepspeed.py`` says which and why).
Where ``import deepspeed`` fails, its modes are left out with the reason.

Printed and kept (``--out``, raw rounds): the median step time (slowest rank: forward + backward +
step) with its spread; tensor bytes per rank (parameters, gradients, fp32 masters, optimizer state;
shardwise's ``engine.memory_report()``, the same tensors on DeepSpeed's objects), counted after a
backward, before its step (DeepSpeed frees its gradient partitions in ``step``), and the experts'
share; ratios to shardwise ZeRO-2 and to shardwise's same mode. A correctness spot check: the first
``--check-steps`` losses of every mode (the mean over ranks, which are the warm-up steps) against a
single process that trains the model on both ranks' micro-batches (gradient accumulation, the same
clipping and optimizer). Tensor bytes, not RSS (glibc keeps freed memory).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = HERE.parent / "results" / "moe.json"
# name -> (implementation, ZeRO stage, EP degree or None); the first is the ratios' base
MODES = {"zero2": ("shardwise", 2, None), "zero2-ep2": ("shardwise", 2, 2), "zero3": ("shardwise", 3, None),
         "zero3-ep2": ("shardwise", 3, 2), "ds-zero2": ("deepspeed", 2, None),
         "ds-zero2-ep2": ("deepspeed", 2, 2)}
CLIP, LR = 1.0, 1e-4


def _model(args: argparse.Namespace):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("mixtral", vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.ffn,
                               num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                               num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=512,
                               output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg)


def _config(stage: int, ep: int | None, args: argparse.Namespace, world: int) -> dict:
    """One config for both implementations: DeepSpeed's keys (shardwise reads the same)."""
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "train_batch_size": args.micro * world,
           "gradient_clipping": CLIP,  # explicit: DeepSpeed's AutoEP clips at 1.0 when it is absent
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10_000}}
    if ep is not None:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"}
    return cfg


def _engine(mode: str, args: argparse.Namespace, world: int):
    impl, stage, ep = MODES[mode]
    cfg = _config(stage, ep, args, world)
    if impl == "deepspeed":
        import bench_moe_deepspeed

        return bench_moe_deepspeed.build_engine(_model(args), cfg)
    import shardwise

    engine, *_ = shardwise.initialize(model=_model(args), config=cfg)
    return engine


def _shardwise_expert_bytes(engine) -> int:
    """The experts' bytes on this rank: their share (by elements) of each group's parameters,
    gradients, masters and optimizer state (a group holds experts only, or none, under EP)."""
    total = 0
    for g in engine.sharding.all_groups:
        m = g.memory()
        state = engine.optimizer.state.get(g.master, {}) if g.master is not None else {}
        opt = sum(v.numel() * v.element_size() for v in state.values() if hasattr(v, "numel") and v.numel() > 1)
        share = sum(n for name, n in zip(g.names, g.numels, strict=True) if ".experts." in name) / g.numel
        total += int(share * (m["params"] + m["grads"] + m["master_params"] + opt))
    return total


def _memory(mode: str, engine) -> dict[str, int]:
    if MODES[mode][0] == "deepspeed":
        import bench_moe_deepspeed

        rep = bench_moe_deepspeed.memory(engine)
        experts = bench_moe_deepspeed.expert_bytes(engine)
    else:
        rep, experts = engine.memory_report(), _shardwise_expert_bytes(engine)
    kinds = ("params", "grads", "master_params", "optimizer_states")
    return {"states": sum(rep[k] for k in kinds), "experts": experts, **{k: int(rep[k]) for k in kinds}}


def _losses(engine, ids, n: int) -> list[float]:
    """``n`` training steps; the loss of each, averaged over the ranks."""
    import torch.distributed as dist

    out = []
    for _ in range(n):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        out.append(t.item() / dist.get_world_size())
    return out


def _reference(args: argparse.Namespace, batches: list, n: int) -> list[float]:
    """One process, the same model and micro-batches: the mean of the ranks' losses per step, the
    gradient of that mean, clipped at ``CLIP``, one AdamW step (the data-parallel math)."""
    import torch

    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    out = []
    for _ in range(n):
        total = 0.0
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss / len(batches)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        out.append(total)
    return out


def _steps(engine, ids, n: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    dist.barrier()
    return (time.perf_counter() - t0) / n


def _measure_memory(engines: dict, ids) -> dict:
    """Each engine's bytes after a backward, before its step (then the step, so nothing is left)."""
    mem = {}
    for mode, e in engines.items():
        e.backward(e(input_ids=ids, labels=ids).loss)
        mem[mode] = _memory(mode, e)
        e.step()
    return mem


def worker(args: argparse.Namespace) -> None:
    """One rank of the job (launched by ``main`` under torchrun)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path[:0] = [str(REPO), str(HERE)]
    import shardwise

    shardwise.init_distributed(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    engines = {mode: _engine(mode, args, world) for mode in args.modes.split(",")}
    batches = [torch.randint(0, 1024, (args.micro, args.seq), generator=torch.Generator().manual_seed(r))
               for r in range(world)]
    ids = batches[rank]
    losses = {mode: _losses(e, ids, args.check_steps) for mode, e in engines.items()}  # also the warm-up
    reference = _reference(args, batches, args.check_steps) if rank == 0 else None
    dist.barrier()
    times: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(args.rounds):
        for mode, e in engines.items():
            times[mode].append(_steps(e, ids, args.steps))
    mem = _measure_memory(engines, ids)
    if rank == 0:
        patch = "not needed"
        if any(MODES[m][0] == "deepspeed" for m in engines):
            import bench_moe_deepspeed

            patch = bench_moe_deepspeed.patch_can_record_registry()  # already applied: says what it did
        Path(args.out).write_text(json.dumps({"times": times, "mem": mem, "losses": losses,
                                              "reference_losses": reference, "deepspeed_patch": patch}))


def _env(python: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error",
               DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(python).parent.parent / "torch_extensions"))  # DeepSpeed JIT
    return env


def _deepspeed_missing(python: str) -> str | None:
    """None when ``python`` imports deepspeed, else why not (its last line of error)."""
    r = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
                       text=True, env=_env(python))
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["failed"])[-1]


def _versions(python: str) -> dict[str, str]:
    code = ("import json, torch, transformers\ntry:\n import deepspeed; d = deepspeed.__version__\n"
            "except Exception:\n d = None\nprint(json.dumps({'torch': torch.__version__, "
            "'transformers': transformers.__version__, 'deepspeed': d}))")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=_env(python))
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {}


def run(args: argparse.Namespace) -> dict:
    """The job, under torchrun, with ``--ds-python`` when a DeepSpeed mode is asked for."""
    impls = set(args.impl.split(","))
    modes = [m for m, (impl, *_) in MODES.items() if impl in impls]
    python, skipped = sys.executable, {}
    if "deepspeed" in impls:
        ds_python = args.ds_python or sys.executable
        if why := _deepspeed_missing(ds_python):
            skipped["deepspeed"] = f"not run: `import deepspeed` fails in {ds_python}: {why}"
            modes = [m for m in modes if MODES[m][0] != "deepspeed"]
        else:
            python = ds_python
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
             ("rounds", "steps", "experts", "hidden", "ffn", "layers", "seq", "micro", "check_steps", "out")]
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, "--worker",
           f"--modes={','.join(modes)}", *flags]
    subprocess.run(cmd, env=_env(python), cwd=REPO, check=True)
    res = json.loads(Path(args.out).read_text())
    res["meta"] = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": _cpu(),
                   "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                   "load_avg_at_end": os.getloadavg(), "skipped": skipped, "versions": _versions(python),
                   "model": f"Mixtral-style, {args.layers} layers, {args.experts} experts (top 2), hidden "
                            f"{args.hidden}, FFN {args.ffn}, vocab 1024, fp32 AdamW lr {LR} wd 0, clip {CLIP}; "
                            f"micro-batch {args.micro} x {args.seq} tokens per rank, 2 gloo ranks",
                   "rounds": args.rounds, "steps_per_round": args.steps,
                   "memory_point": "after a backward, before its step; tensor bytes per rank (rank 0)"}
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "?")
    except OSError:
        return "?"


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}" if b else "-"


def render(res: dict) -> str:
    """The docs' tables from a results file: speed and memory, then the loss spot check."""
    times, mem = res["times"], res["mem"]
    med = {m: statistics.median(ts) for m, ts in times.items()}
    twin = {m: m.removeprefix("ds-") for m in times}  # shardwise's same mode
    lines = ["| mode | impl | step (median) | spread | vs zero2 | vs shardwise same mode | bytes/rank (states) | "
             "vs zero2 | vs shardwise | expert bytes/rank | vs shardwise |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, ts in times.items():
        mm, tw = mem[m], mem.get(twin[m], {})
        lines.append(f"| {m} | {MODES[m][0]} | {med[m] * 1e3:.0f} ms | {min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f} | "
                     f"{_ratio(med[m], med.get('zero2'))} | {_ratio(med[m], med.get(twin[m]))} | "
                     f"{mm['states'] / 2**20:.1f} MiB | {_ratio(mm['states'], mem.get('zero2', {}).get('states'))} | "
                     f"{_ratio(mm['states'], tw.get('states'))} | {mm['experts'] / 2**20:.1f} MiB | "
                     f"{_ratio(mm['experts'], tw.get('experts'))} |")
    ref = res.get("reference_losses")
    if ref:
        lines += ["", "| mode | " + " | ".join(f"loss step {i + 1}" for i in range(len(ref))) + " | max abs diff |",
                  "|---|" + "---:|" * (len(ref) + 1),
                  "| single process | " + " | ".join(f"{x:.6f}" for x in ref) + " | - |"]
        for m, ls in res.get("losses", {}).items():
            diff = max(abs(a - b) for a, b in zip(ls, ref, strict=True))
            lines.append(f"| {m} | " + " | ".join(f"{x:.6f}" for x in ls) + f" | {diff:.1e} |")
    meta = res.get("meta", {})
    for impl, why in meta.get("skipped", {}).items():
        lines += ["", f"{impl}: {why}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="shardwise,deepspeed", help="comma list of shardwise, deepspeed")
    p.add_argument("--ds-python", default=os.environ.get("DS_PYTHON"),
                   help="interpreter that imports deepspeed (default: $DS_PYTHON, else this one)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="steps timed per mode per round")
    p.add_argument("--check-steps", type=int, default=4, help="steps of the loss spot check (also the warm-up)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--out", default=str(RESULTS), help="raw rounds, bytes and losses (the tables print from it)")
    p.add_argument("--from-json", help="print the tables of a results file; run nothing")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--modes", default=",".join(MODES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    res = json.loads(Path(args.from_json).read_text()) if args.from_json else run(args)
    print(render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
